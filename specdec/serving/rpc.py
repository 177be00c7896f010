"""gRPC plumbing shared by the services: errors that map to status codes, server start-up,
and a client call that measures serialization, wire time and bytes separately."""
from __future__ import annotations

import functools
import hmac
import inspect
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
import uuid
import weakref
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.core.errors import PastContext, RequestError, StaleSession

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 2**20  # limits.max_message_mib's default
# A request keeps at most a few calls in flight at a service (a round's call, an overlapped
# draft, EndSession, a health check): the services queue no more than this many per request.
SERVICE_CALLS_PER_REQUEST = 4


def message_options(max_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """gRPC options bounding each message, both ways."""
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


class ServiceError(Exception):
    """An error to report to the caller with a gRPC status code and a clear message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


# Downstream statuses passed on as they are: they concern the request (its size, its deadline,
# the load), not a fault between the services.
RELAYED_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.CANCELLED,
})


def reports_errors(method: Callable) -> Callable:
    """Turns ServiceError (and unexpected failures) into a gRPC status on the call, so one bad
    request never takes the service down. Works for unary and server-streaming handlers."""

    def abort(context, err: Exception):
        if isinstance(err, ServiceError):
            context.abort(err.code, err.message)
        if isinstance(err, RequestError):  # the domain's own errors (specdec/core/errors.py)
            code = (
                grpc.StatusCode.FAILED_PRECONDITION if isinstance(err, StaleSession)
                else grpc.StatusCode.OUT_OF_RANGE if isinstance(err, PastContext)
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            context.abort(code, str(err))
        downstream = isinstance(err, grpc.RpcError) and isinstance(err, grpc.Call)
        if downstream and err.code() in RELAYED_CODES:  # a downstream service's answer the caller can act on
            context.abort(err.code(), err.details())
        # Anything else is this side's fault, not the caller's: no internals in the answer.
        request_id = uuid.uuid4().hex[:12]
        if downstream:
            log.error("request %s: a downstream call in %s failed: %s %s", request_id, method.__name__, err.code().name, err.details())
        else:
            log.exception("request %s: internal error in %s", request_id, method.__name__)
        context.abort(grpc.StatusCode.INTERNAL, f"internal error (request id {request_id}); the details are in the service's log")

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as err:  # noqa: BLE001 - reported to the caller, service goes on
                abort(context, err)

        return stream_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as err:  # noqa: BLE001 - reported to the caller, service goes on
            abort(context, err)

    return wrapper


# Ports handed out below the kernel's ephemeral range (32768+, where every outgoing connection
# takes one) and above Ray's worker ports (10002-19999): a port chosen there stays free until
# the server that asked for it binds, even while Ray starts its processes meanwhile.
_QUIET_PORTS = range(20000, 32000)


def free_port(host: str = "localhost") -> int:
    """A TCP port free on `host` now, for a server the caller starts next (tests, the local cluster)."""
    for port in random.sample(_QUIET_PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all 64 taken: any port the kernel gives
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(
    add_servicer: Callable[[grpc.Server], None],
    host: str,
    port: int,
    max_workers: int = 16,
    health_service: str | None = None,
    interceptors: tuple[grpc.ServerInterceptor, ...] = (),
    tls: tuple[bytes, bytes] | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    max_calls: int | None = None,
    client_ca: bytes | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Starts a gRPC server with the standard health service and server reflection (so grpcurl
    works without the protos); returns it, the bound port and the health servicer. `tls`:
    (private key, certificate chain), PEM; None = plaintext; with `client_ca` callers must show a
    certificate it signed (mutual TLS). Past `max_calls` calls at once
    (running or queued for a worker thread) gRPC answers RESOURCE_EXHAUSTED instead of queueing."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers), options=message_options(max_message_bytes), interceptors=interceptors,
        maximum_concurrent_rpcs=max_calls,
    )
    add_servicer(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health_service] if health_service else []
    reflection.enable_server_reflection(
        names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
    )
    if tls:
        credentials = grpc.ssl_server_credentials([tls], root_certificates=client_ca, require_client_auth=client_ca is not None)
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind a gRPC server to {host}:{port}")
    server.start()
    status = health_pb2.HealthCheckResponse.SERVING
    health_servicer.set("", status)
    if health_service:
        health_servicer.set(health_service, status)
    _health_of[server] = health_servicer
    return server, bound, health_servicer


def start_model_server(
    add_servicer: Callable[[grpc.Server], None], service: str, host: str, port: int, limits, service_token: str, tls=None
):
    """A model service's server (drafter, verifier): its calls at once and message sizes within
    `limits` (LimitsConfig), and, with `service_token`, only callers that show it (health,
    reflection and Info stay open); `tls` (ServiceTlsConfig): TLS only, mutual where it says.
    Returns (server, bound port)."""
    pair, client_ca = tls.server_credentials() if tls is not None and tls.enabled else (None, None)
    server, bound, _ = start_server(
        add_servicer,
        host,
        port,
        health_service=service,
        interceptors=(BearerTokenAuth(service, {service_token}, open_methods=("Info",)),) if service_token else (),
        max_message_bytes=int(limits.max_message_mib * 2**20),
        max_calls=SERVICE_CALLS_PER_REQUEST * limits.max_concurrent_requests,
        max_workers=limits.max_concurrent_requests + 4,  # a handler waits for its batch: one per request in flight
        tls=pair,
        client_ca=client_ca,
    )
    return server, bound


def bearer_accepted(header: str, tokens: set[str]) -> bool:
    """Whether an `authorization` value is `Bearer <t>` with t among `tokens` (compared in constant time)."""
    given = header.removeprefix("Bearer ").encode() if header.startswith("Bearer ") else b""
    return any(hmac.compare_digest(given, token.encode()) for token in tokens)


class BearerTokenAuth(grpc.ServerInterceptor):
    """Calls to `service` need the metadata `authorization: Bearer <token>` with an accepted
    token, else UNAUTHENTICATED; health checks, reflection and `open_methods` stay open
    (probes, grpcurl, monitoring)."""

    def __init__(self, service: str, tokens: set[str], open_methods: tuple[str, ...] = ()):
        if not tokens:
            raise ValueError("BearerTokenAuth needs at least one token")
        self.open = {f"/{service}/{method}" for method in open_methods}
        self.prefix = f"/{service}/"
        self.tokens = tokens

        def deny(request, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token: send the metadata 'authorization: Bearer <token>'"
            )

        self.deny = {False: grpc.unary_unary_rpc_method_handler(deny), True: grpc.unary_stream_rpc_method_handler(deny)}

    def intercept_service(self, continuation, handler_call_details):
        if not handler_call_details.method.startswith(self.prefix) or handler_call_details.method in self.open:
            return continuation(handler_call_details)
        if bearer_accepted(dict(handler_call_details.invocation_metadata).get("authorization", ""), self.tokens):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        return None if handler is None else self.deny[handler.response_streaming]


_health_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # server -> its health servicer
SHUTDOWN_DRAIN_S = 2.0  # NOT_SERVING, still answering, so health checkers notice before calls are refused
SHUTDOWN_GRACE_S = 30.0  # then how long calls in flight may take to finish


def stop_gracefully(server: grpc.Server, drain_s: float = SHUTDOWN_DRAIN_S, grace_s: float = SHUTDOWN_GRACE_S) -> threading.Event:
    """Health turns NOT_SERVING at once; after `drain_s` new calls are refused and calls in
    flight get `grace_s` more to finish. Returns at once: the event is set once it stopped."""
    health_servicer = _health_of.get(server)
    if health_servicer is not None:
        health_servicer.enter_graceful_shutdown()
    stopped = threading.Event()

    def stop() -> None:
        time.sleep(drain_s)
        server.stop(grace=grace_s).wait()
        stopped.set()

    threading.Thread(target=stop, name="graceful-stop", daemon=True).start()
    return stopped


def set_serving(server: grpc.Server, service: str, serving: bool) -> None:
    """What the server's health service says of `service` (a server stopping stays NOT_SERVING)."""
    health_servicer = _health_of.get(server)
    if health_servicer is not None:
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING)


def serve_until_terminated(server: grpc.Server) -> NoReturn:
    """A service process's end: blocks until SIGTERM or Ctrl-C, stops the server gracefully,
    then exits at once. Interpreter shutdown would have nothing left to do but races with the
    native threads of gRPC and torch, and a thread it stops inside C++ aborts the process
    ("terminate called without an active exception", seen once in a CI run)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    stop_gracefully(server).wait()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def open_channel(
    address: str, credentials: grpc.ChannelCredentials | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES, server_name: str = "",
) -> grpc.Channel:
    """A channel to `address`: TLS with `credentials` (the certificate checked for `server_name`
    where given, else for the host dialed), or plaintext without them."""
    options = message_options(max_message_bytes)
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.secure_channel(address, credentials, options=options)


def trusting(root_certificates: bytes | None) -> grpc.ChannelCredentials | None:
    """Credentials that check a server's certificate against `root_certificates` (PEM); None = plaintext."""
    return None if root_certificates is None else grpc.ssl_channel_credentials(root_certificates)


def wait_until_serving(address: str, timeout_s: float, service: str = "", root_certificates: bytes | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    with open_channel(address, trusting(root_certificates)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no SERVING health status from {address} within {timeout_s:.0f} s")
            time.sleep(0.25)


@dataclass
class CallCost:
    """What one RPC cost the caller, split into its parts."""

    serialize_ms: float = 0.0
    call_ms: float = 0.0       # from bytes handed to gRPC to bytes back
    deserialize_ms: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def total_ms(self) -> float:
        return self.serialize_ms + self.call_ms + self.deserialize_ms


class MeasuredClient:
    """Unary calls on raw bytes, so encode, wire and decode are timed apart. `token`: the
    bearer token the service asks of its callers ("" = none); `tls` (ServiceTlsConfig): the
    service speaks TLS, checked against its CA (and this client shows its own certificate)."""

    def __init__(self, address: str, service: str, token: str = "", max_message_bytes: int = MAX_MESSAGE_BYTES, tls=None):
        self.address = address
        secure = tls is not None and tls.enabled
        self.channel = open_channel(
            address, tls.channel_credentials() if secure else None, max_message_bytes, tls.server_name if secure else ""
        )
        self._service = service
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._methods: dict[str, Callable] = {}

    def _stub(self, method: str) -> Callable:
        stub = self._methods.get(method)
        if stub is None:
            stub = self.channel.unary_unary(f"/{self._service}/{method}")
            self._methods[method] = stub
        return stub

    def call_async(self, method: str, request, timeout: float = 10.0) -> grpc.Future:
        """Fire and forget, for clean-up calls whose answer nobody waits for."""
        return self._stub(method).future(request.SerializeToString(), timeout=timeout, metadata=self._metadata)

    def call(self, method: str, request, response_type, timeout: float | None = 120.0):
        stub = self._stub(method)
        t0 = time.perf_counter()
        payload = request.SerializeToString()
        t1 = time.perf_counter()
        reply = stub(payload, timeout=timeout, metadata=self._metadata)
        t2 = time.perf_counter()
        response = response_type.FromString(reply)
        t3 = time.perf_counter()
        cost = CallCost(
            serialize_ms=(t1 - t0) * 1e3,
            call_ms=(t2 - t1) * 1e3,
            deserialize_ms=(t3 - t2) * 1e3,
            bytes_sent=len(payload),
            bytes_received=len(reply),
        )
        return response, cost

    def reachable(self, timeout_s: float = 2.0) -> bool:
        """Whether the service answers its health check with SERVING."""
        try:
            reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=self._service), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self.channel.close()


class InProcessError(grpc.RpcError):
    """A status an in-process service aborted with, read like a remote call's error."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _AbortingContext:
    def abort(self, code: grpc.StatusCode, details: str):
        raise InProcessError(code, details)


class InProcessClient:
    """A servicer called in this process with MeasuredClient's interface and error semantics,
    for a service whose round trip costs more than its work (a drafter without a model)."""

    def __init__(self, servicer, name: str):
        self.address = f"in-process:{name}"
        self._servicer = servicer

    def call(self, method: str, request, response_type, timeout: float | None = None):
        start = time.perf_counter()
        response = getattr(self._servicer, method)(request, _AbortingContext())
        return response, CallCost(call_ms=(time.perf_counter() - start) * 1e3)

    def call_async(self, method: str, request, timeout: float = 10.0) -> None:
        self.call(method, request, None)

    def reachable(self, timeout_s: float = 2.0) -> bool:
        return True

    def close(self) -> None:
        pass
