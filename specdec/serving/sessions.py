"""Per-session state kept by a service, bounded in number and age."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Generic, TypeVar

import grpc

from specdec.core.kv_cache import cache_nbytes
from specdec.serving.config import LimitsConfig
from specdec.serving.rpc import ServiceError, invalid

State = TypeVar("State")


class SessionStore(Generic[State]):
    """Sessions by id. The least recently used session is evicted when the store is full, or
    when the sessions' memory (`size_of`) passes max_bytes (0 = no bound), and any session
    idle for longer than ttl_s; the caller then re-opens it with its full context. `evicted`
    counts these evictions since the store was made (not sessions ended, nor dropped after a
    failure)."""

    def __init__(self, max_sessions: int, ttl_s: float, max_bytes: int = 0, size_of: Callable[[State], int] = lambda state: 0):
        self._max = max_sessions
        self._ttl = ttl_s
        self._max_bytes = max_bytes
        self._size_of = size_of
        self._items: OrderedDict[str, tuple[State, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0

    @classmethod
    def of_caches(cls, limits: LimitsConfig) -> SessionStore:
        """A model service's store: sessions whose `cache` counts against limits.max_kv_mib."""
        return cls(limits.max_sessions, limits.session_ttl_s, int(limits.max_kv_mib * 2**20), lambda session: cache_nbytes(session.cache))

    def get(self, session_id: str) -> State:
        with self._lock:
            self._expire()
            item = self._items.get(session_id)
            if item is None:
                raise ServiceError(
                    grpc.StatusCode.NOT_FOUND,
                    f"unknown session '{session_id}': it was never opened here or was evicted; re-open it with `start`",
                )
            self._items[session_id] = (item[0], time.monotonic())
            self._items.move_to_end(session_id)
            return item[0]

    def put(self, session_id: str, state: State) -> None:
        with self._lock:
            self._items[session_id] = (state, time.monotonic())
            self._items.move_to_end(session_id)
            while len(self._items) > self._max:
                self._items.popitem(last=False)
                self.evicted += 1

    def fit(self, session_id: str) -> None:
        """Evicts the least recently used sessions other than `session_id` until all of them
        together hold at most max_bytes (a session that grew)."""
        if not self._max_bytes:
            return
        with self._lock:
            total = self._total()
            for key in [k for k in self._items if k != session_id]:
                if total <= self._max_bytes:
                    break
                total -= self._size_of(self._items.pop(key)[0])
                self.evicted += 1

    def nbytes(self) -> int:
        """Memory all sessions hold together."""
        with self._lock:
            return self._total()

    def _total(self) -> int:
        return sum(self._size_of(state) for state, _ in self._items.values())

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def pop(self, session_id: str) -> State | None:
        with self._lock:
            item = self._items.pop(session_id, None)
            return item[0] if item else None

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, (_, seen) in self._items.items() if now - seen > self._ttl]:
            del self._items[key]
            self.evicted += 1


@contextmanager
def dropped_on_failure(store: SessionStore, session_id: str):
    """A call that fails unexpectedly part-way (not a refused request) may leave its session's
    state half-updated, a cache half-extended: the session goes, and the caller re-opens it
    with the full context."""
    try:
        yield
    except ServiceError:
        raise
    except Exception:
        store.pop(session_id)
        raise


def check_kv_room(tokens: int, bytes_per_token: int, limits: LimitsConfig) -> None:
    """Refuses a call that would grow one session's KV cache past limits.max_session_kv_mib,
    before its forward."""
    max_bytes = limits.max_session_kv_mib * 2**20
    if tokens * bytes_per_token > max_bytes:
        raise ServiceError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{tokens} tokens need {tokens * bytes_per_token / 2**20:.0f} MiB of KV cache; a session may hold at most "
            f"{max_bytes / 2**20:.0f} MiB (limits.max_session_kv_mib)",
        )


def check_context(context: list[int], vocab_size: int, max_len: int, field_name: str) -> None:
    if not context:
        raise invalid(f"{field_name} is empty")
    if len(context) >= max_len:
        raise invalid(f"{field_name} has {len(context)} tokens; the model's context is {max_len}")
    bad = [t for t in context if not 0 <= t < vocab_size]
    if bad:
        raise invalid(f"{field_name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
