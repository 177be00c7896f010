"""A small client for the Coordinator API, used by `specdec generate` and the benchmark."""
from __future__ import annotations

from typing import Iterator

from specdec.serving.rpc import open_channel, trusting
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc


def generate_request(prompt: str = "", **fields) -> coordinator_pb2.GenerateRequest:
    """A GenerateRequest; fields left as None stay unset (the server's defaults)."""
    return coordinator_pb2.GenerateRequest(prompt=prompt, **{k: v for k, v in fields.items() if v is not None})


def server_token(config) -> str | None:
    """A token the configured server accepts (None when it takes any caller): for the clients
    started beside it, the demo and the benchmarks."""
    return min(config.coordinator.auth.accepted(), default=None)


def server_ca(config) -> bytes | None:
    """The root certificates the configured server's TLS checks against (None = plaintext)."""
    tls = config.coordinator.tls
    return tls.trusted() if tls.enabled else None


class CoordinatorClient:
    def __init__(self, address: str, token: str | None = None, root_certificates: bytes | None = None):
        """`token`: a bearer token, for a server with coordinator.auth set; `root_certificates`:
        PEM the server's TLS certificate is checked against (None = plaintext)."""
        self.channel = open_channel(address, trusting(root_certificates))
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None

    def generate(self, request: coordinator_pb2.GenerateRequest, timeout: float = 600.0) -> coordinator_pb2.GenerateResponse:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def stream(self, request: coordinator_pb2.GenerateRequest, timeout: float = 600.0) -> Iterator[coordinator_pb2.GenerateResponse]:
        return self.stub.GenerateStream(request, timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


def format_stats(stats: coordinator_pb2.RoundStats) -> str:
    return (
        f"{stats.generated_tokens} tokens in {stats.total_ms / 1e3:.2f} s ({stats.tokens_per_second:.1f} tok/s, "
        f"the first after {stats.first_token_ms / 1e3:.2f} s), {stats.rounds} rounds, "
        + (f"mean budget {stats.mean_budget:.1f}, " if stats.policy == "adaptive" else f"budget {stats.speculation_budget}, ")
        + f"{stats.mean_accepted_per_round:.2f} accepted drafts/round\n"
        f"draft {stats.draft_compute_ms:.0f} ms, verify {stats.verify_compute_ms:.0f} ms, "
        f"wire+serialization {stats.wire_serialization_ms:.0f} ms (serialization {stats.serialization_ms:.1f} ms), "
        f"sent {stats.bytes_sent} B, received {stats.bytes_received} B\n"
        f"policy {stats.policy}{' with overlap' if stats.overlap else ''}, rounds per plan: "
        + ", ".join(f"{plan} {n}" for plan, n in sorted(stats.plan_rounds.items()))
        + (
            f"\nsteering: {stats.steering_bytes} B, verifier {stats.verify_steering_ms:.1f} ms, drafter {stats.draft_steering_ms:.1f} ms"
            if stats.steering
            else ""
        )
    )
