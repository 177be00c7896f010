"""The speculative round loop and what it measures. One screen: draft, verify, commit."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator

from coordinator.clients import PairSession
from specdec.tree import TreeShape
from specdec.v1 import coordinator_pb2


@dataclass
class Meter:
    """Per-request totals of what the rounds cost."""

    rounds: int = 0
    speculative_rounds: int = 0
    accepted: int = 0
    drafted: int = 0
    draft_compute_ms: float = 0.0
    verify_compute_ms: float = 0.0
    overhead_ms: float = 0.0
    serialization_ms: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    started: float = field(default_factory=time.perf_counter)

    def add_call(self, call, is_draft: bool) -> None:
        if is_draft:
            self.draft_compute_ms += call.compute_ms
        else:
            self.verify_compute_ms += call.compute_ms
        self.overhead_ms += call.overhead_ms
        self.serialization_ms += call.cost.serialize_ms + call.cost.deserialize_ms
        self.bytes_sent += call.cost.bytes_sent
        self.bytes_received += call.cost.bytes_received

    def stats(self, budget: int, tree_method: str, generated: int) -> coordinator_pb2.RoundStats:
        total_ms = (time.perf_counter() - self.started) * 1e3
        return coordinator_pb2.RoundStats(
            rounds=self.rounds,
            mean_accepted_per_round=self.accepted / self.speculative_rounds if self.speculative_rounds else 0.0,
            draft_compute_ms=self.draft_compute_ms,
            verify_compute_ms=self.verify_compute_ms,
            wire_serialization_ms=self.overhead_ms,
            serialization_ms=self.serialization_ms,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            speculation_budget=budget,
            total_ms=total_ms,
            generated_tokens=generated,
            tokens_per_second=generated / (total_ms / 1e3) if total_ms > 0 else 0.0,
            accepted_draft_tokens=self.accepted,
            drafted_tokens=self.drafted,
            tree_method=tree_method if budget else "",
            bytes_per_round=(self.bytes_sent + self.bytes_received) / self.rounds if self.rounds else 0.0,
        )


def decode_rounds(
    session: PairSession, budget: int, shape: TreeShape, fused_block: int, max_new_tokens: int, meter: Meter
) -> Iterator[list[int]]:
    """Yields each round's newly committed tokens (accepted drafts, then the verifier's own
    token) until max_new_tokens are out; the caller stops early on EOS or a stop string.
    budget = draft tree nodes per round, spent as `shape` says; 0 = verifier alone."""
    generated = 0
    while generated < max_new_tokens:
        remaining = max_new_tokens - generated
        depth = min(shape.max_depth or budget, remaining - 1)  # the verifier always adds one token
        if budget > 0 and depth > 0:
            draft, draft_call = session.draft(budget, replace(shape, max_depth=depth))
            meter.add_call(draft_call, is_draft=True)
            verdict, verify_call = session.verify(draft.tree)
            meter.speculative_rounds += 1
            meter.accepted += verdict.num_accepted_draft_tokens
            meter.drafted += len(draft.tree.token_ids)
        else:
            verdict, verify_call = session.verify(None, fused_tokens=min(fused_block, remaining))
        meter.add_call(verify_call, is_draft=False)
        meter.rounds += 1
        generated += len(verdict.token_ids)
        yield list(verdict.token_ids)
