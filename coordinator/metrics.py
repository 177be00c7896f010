"""Prometheus metrics through ray.serve.metrics: what every finished request measured, so a
dashboard shows acceptance, speed, the chosen budgets, where round time goes, and bytes.
Ray exports them with the rest of the cluster's metrics (port 8080 of each node by default).
Acceptance is also counted under vLLM's speculative decoding names (without its `vllm:`
namespace): acceptance rate = spec_decode_num_accepted_tokens / spec_decode_num_draft_tokens,
mean acceptance length = 1 + spec_decode_num_accepted_tokens / spec_decode_num_drafts, and
per-position acceptance from spec_decode_num_accepted_tokens_per_pos{position}."""
from __future__ import annotations

from ray.serve import metrics

from specdec.v1 import coordinator_pb2


class RequestMetrics:
    def __init__(self):
        tags = ("policy", "tree")
        self.requests = metrics.Counter("specdec_requests", "finished generation requests", tag_keys=tags)
        self.tokens = metrics.Counter("specdec_generated_tokens", "generated tokens", tag_keys=tags)
        self.rounds = metrics.Counter("specdec_rounds", "rounds per plan (fused, chain-4, rsd-s-16, ...)", tag_keys=("plan",))
        self.accepted = metrics.Counter("specdec_accepted_draft_tokens", "draft tokens the verifier accepted", tag_keys=tags)
        self.drafted = metrics.Counter("specdec_drafted_tokens", "draft tree nodes sent to the verifier", tag_keys=tags)
        self.tokens_per_second = metrics.Gauge("specdec_tokens_per_second", "tokens per second of the last request", tag_keys=tags)
        self.budget = metrics.Histogram(
            "specdec_mean_budget", "draft nodes per round, per request", boundaries=[0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5], tag_keys=tags
        )
        self.round_ms = metrics.Counter(
            "specdec_round_time_ms",
            "round time by part: draft_compute, verify_compute, draft_wire, verify_wire (serialization is part of the wire parts)",
            tag_keys=("part",),
        )
        self.bytes = metrics.Counter("specdec_bytes", "bytes on the service links, by direction (sent, received)", tag_keys=("direction",))
        self.steering_bytes = metrics.Counter("specdec_steering_bytes", "SD2 steering vector bytes (verifier -> coordinator -> drafter)")
        self.steering_ms = metrics.Counter("specdec_steering_ms", "SD2 steering compute inside the services", tag_keys=("service",))
        self.verifier_state_bytes = metrics.Counter(
            "specdec_verifier_state_bytes", "verifier state bytes for the drafter (verifier -> coordinator -> drafter)"
        )
        self.drafter_failures = metrics.Counter(
            "specdec_drafter_failures", "failed Draft calls (the request went on with the verifier alone)"
        )
        self.session_reopens = metrics.Counter(
            "specdec_session_reopens", "calls re-sent with the whole context: the service had lost the session (evicted, restarted)"
        )
        self.num_drafts = metrics.Counter("spec_decode_num_drafts", "rounds that verified a draft")
        self.num_draft_tokens = metrics.Counter("spec_decode_num_draft_tokens", "draft tokens sent to the verifier")
        self.num_accepted = metrics.Counter("spec_decode_num_accepted_tokens", "draft tokens the verifier accepted")
        self.accepted_per_pos = metrics.Counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "rounds whose draft token at this position (0 = first) was accepted",
            tag_keys=("position",),
        )

    def record(self, stats: coordinator_pb2.RoundStats) -> None:
        tags = {"policy": stats.policy, "tree": stats.tree_method or "none"}
        increments = [
            (self.requests, 1, tags),
            (self.tokens, stats.generated_tokens, tags),
            (self.accepted, stats.accepted_draft_tokens, tags),
            (self.drafted, stats.drafted_tokens, tags),
            (self.round_ms, stats.draft_compute_ms, {"part": "draft_compute"}),
            (self.round_ms, stats.verify_compute_ms, {"part": "verify_compute"}),
            (self.round_ms, stats.draft_wire_ms, {"part": "draft_wire"}),
            (self.round_ms, stats.verify_wire_ms, {"part": "verify_wire"}),
            (self.round_ms, stats.serialization_ms, {"part": "serialization"}),
            (self.bytes, stats.bytes_sent, {"direction": "sent"}),
            (self.bytes, stats.bytes_received, {"direction": "received"}),
            (self.steering_bytes, stats.steering_bytes, None),
            (self.steering_ms, stats.verify_steering_ms, {"service": "verifier"}),
            (self.steering_ms, stats.draft_steering_ms, {"service": "drafter"}),
            (self.verifier_state_bytes, stats.verifier_state_bytes, None),
            (self.drafter_failures, stats.drafter_failures, None),
            (self.session_reopens, stats.session_reopens, None),
            (self.num_drafts, stats.speculative_rounds, None),
            (self.num_draft_tokens, stats.drafted_tokens, None),
            (self.num_accepted, stats.accepted_draft_tokens, None),
        ]
        increments += [(self.accepted_per_pos, count, {"position": str(d)}) for d, count in enumerate(stats.accepted_per_position)]
        increments += [(self.rounds, rounds, {"plan": plan}) for plan, rounds in stats.plan_rounds.items()]
        for counter, value, counter_tags in increments:
            if value > 0:  # Ray counters refuse increments of 0
                counter.inc(value, counter_tags)
        self.tokens_per_second.set(stats.tokens_per_second, tags)
        self.budget.observe(stats.mean_budget, tags)
