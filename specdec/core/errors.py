"""The model-side code's errors, by what a request got wrong. The servers answer each with its
gRPC status (specdec/serving/rpc.py `reports_errors`), so the code that raises them speaks no gRPC."""
from __future__ import annotations


class RequestError(Exception):
    """A request the code cannot serve as asked: INVALID_ARGUMENT."""


class StaleSession(RequestError):
    """A request that needs state its session no longer holds; re-opening it helps: FAILED_PRECONDITION."""


class PastContext(RequestError):
    """A request that would take a session past its model's context: OUT_OF_RANGE."""
