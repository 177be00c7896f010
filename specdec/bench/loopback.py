"""The floor a hop can reach: a bare unary gRPC call on localhost, server and client in this
process, carrying raw payloads of a hop's sizes and doing nothing else."""
from __future__ import annotations

import statistics
import time
from concurrent import futures

import grpc

ECHO_METHOD = "/specdec.bench.Loopback/Echo"


def loopback_call_ms(request_bytes: int, response_bytes: int, calls: int = 200, warmup: int = 20) -> float:
    """The median ms of `calls` calls sending `request_bytes` and answered with `response_bytes`
    (after `warmup` untimed ones, which open the connection)."""
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
                start = time.perf_counter()
                echo(request, timeout=10)
                if i >= warmup:
                    times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    finally:
        server.stop(grace=None)
