"""The floor a hop can reach: a bare unary gRPC call on localhost, server and client in this
process, carrying raw payloads of a hop's sizes and doing nothing else, after the idle time the
hop sees in a round. Idle matters: on a 2-core VM a bare call takes ~0.4-0.6 ms back to back
and ~1.3 ms after 10 ms idle (a raw TCP round trip between processes: 0.09 and 0.14 ms), since
gRPC's threads go to sleep between rounds."""
from __future__ import annotations

import statistics
import time
from concurrent import futures

import grpc

ECHO_METHOD = "/specdec.bench.Loopback/Echo"


def loopback_call_ms(request_bytes: int, response_bytes: int, idle_ms: float = 0.0, calls: int = 100, warmup: int = 10) -> float:
    """The median ms of `calls` calls sending `request_bytes` and answered with `response_bytes`,
    each after `idle_ms` without a call (after `warmup` untimed ones, which open the connection)."""
    response = bytes(response_bytes)
    handler = grpc.method_handlers_generic_handler(
        "specdec.bench.Loopback", {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: response)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=(handler,))
    port = server.add_insecure_port("localhost:0")
    server.start()
    try:
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            echo, request = channel.unary_unary(ECHO_METHOD), bytes(request_bytes)
            times = []
            for i in range(warmup + calls):
                time.sleep(idle_ms / 1e3)
                start = time.perf_counter()
                echo(request, timeout=10)
                if i >= warmup:
                    times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    finally:
        server.stop(grace=None)
