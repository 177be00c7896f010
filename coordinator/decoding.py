"""The speculative round loop and what it measures. One screen: draft, verify, commit."""
from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import Iterator, Protocol

import grpc

from coordinator.budget import (
    EmptyDraftBlocks,
    Plan,
    RoundReport,
    VerifyCosts,
    goodput_cut,
)
from coordinator.clients import PairSession
from specdec.core.grammar import constrain_draft
from specdec.core.tree import ROOT, DraftTree, TreeShape
from specdec.serving.wire import tree_from_proto, tree_to_proto
from specdec.v1 import common_pb2, coordinator_pb2, drafter_pb2

log = logging.getLogger(__name__)


@dataclass
class Anatomy:
    """Sums over rounds of one kind of what each part of a round cost (RoundAnatomy)."""

    rounds: int = 0
    round_ms: float = 0.0
    draft_compute_ms: float = 0.0
    verify_compute_ms: float = 0.0
    draft_hop_ms: float = 0.0
    verify_hop_ms: float = 0.0
    draft_in_service_ms: float = 0.0
    verify_in_service_ms: float = 0.0
    draft_request_bytes: int = 0
    draft_response_bytes: int = 0
    verify_request_bytes: int = 0
    verify_response_bytes: int = 0

    def add(self, report: RoundReport, draft_call, verify_call) -> None:
        """A round's report, with its Draft call (None when it drafted nothing) and Verify call."""
        self.rounds += 1
        self.round_ms += report.wall_ms
        self.draft_compute_ms += report.draft_ms
        self.verify_compute_ms += report.verify_ms
        self.draft_hop_ms += report.draft_wire_ms
        self.verify_hop_ms += report.verify_wire_ms
        if draft_call is not None:
            self.draft_in_service_ms += draft_call.in_service_ms
            self.draft_request_bytes += draft_call.cost.bytes_sent
            self.draft_response_bytes += draft_call.cost.bytes_received
        self.verify_in_service_ms += verify_call.in_service_ms
        self.verify_request_bytes += verify_call.cost.bytes_sent
        self.verify_response_bytes += verify_call.cost.bytes_received

    def means(self) -> coordinator_pb2.RoundAnatomy:
        if not self.rounds:
            return coordinator_pb2.RoundAnatomy()
        mean = {f.name: getattr(self, f.name) / self.rounds for f in fields(self) if f.name != "rounds"}
        compute = mean["draft_compute_ms"] + mean["verify_compute_ms"]
        hops = mean["draft_hop_ms"] + mean["verify_hop_ms"]
        return coordinator_pb2.RoundAnatomy(
            rounds=self.rounds, **mean, overhead_ms=mean["round_ms"] - compute, coordinator_ms=mean["round_ms"] - compute - hops
        )


@dataclass
class Meter:
    """Per-request totals of what the rounds cost."""

    rounds: int = 0
    speculative_rounds: int = 0
    accepted: int = 0
    drafted: int = 0
    draft_compute_ms: float = 0.0
    verify_compute_ms: float = 0.0
    draft_wire_ms: float = 0.0
    verify_wire_ms: float = 0.0
    serialization_ms: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    budget_total: int = 0
    steering_bytes: int = 0
    verifier_state_bytes: int = 0
    draft_steering_ms: float = 0.0
    verify_steering_ms: float = 0.0
    overlap_hits: int = 0
    drafter_failures: int = 0
    draft_forward_passes: int = 0
    draft_own_tokens: int = 0
    draft_reencode_rollbacks: int = 0
    draft_mapping_ms: float = 0.0
    # Structured outputs (RoundStats' grammar_* and forced fields): the constraint's compile, the
    # verifier's masking, the coordinator's forced tokens and pruning; forced tokens drafted and accepted.
    grammar_compile_ms: float = 0.0
    grammar_mask_ms: float = 0.0
    grammar_draft_ms: float = 0.0
    forced: int = 0
    accepted_forced: int = 0
    accepted_counts: Counter = field(default_factory=Counter)  # speculative rounds by draft tokens accepted
    plan_rounds: Counter = field(default_factory=Counter)
    speculative_anatomy: Anatomy = field(default_factory=Anatomy)
    verifier_alone_anatomy: Anatomy = field(default_factory=Anatomy)
    started: float = field(default_factory=time.perf_counter)
    first_token_ms: float = 0.0

    def add_call(self, call, is_draft: bool) -> None:
        if is_draft:
            self.draft_compute_ms += call.compute_ms
            self.draft_wire_ms += call.overhead_ms
            self.draft_steering_ms += call.steering_ms
            self.draft_own_tokens += call.own_tokens_drafted
            self.draft_reencode_rollbacks += call.reencode_rollbacks
            self.draft_mapping_ms += call.mapping_ms
        else:
            self.verify_compute_ms += call.compute_ms
            self.verify_wire_ms += call.overhead_ms
            self.verify_steering_ms += call.steering_ms
            self.grammar_mask_ms += call.grammar_ms
        self.steering_bytes += call.steering_bytes
        self.verifier_state_bytes += call.verifier_state_bytes
        self.draft_forward_passes += call.forward_passes
        self.serialization_ms += call.cost.serialize_ms + call.cost.deserialize_ms
        self.bytes_sent += call.cost.bytes_sent
        self.bytes_received += call.cost.bytes_received

    def add_plan(self, plan: Plan) -> None:
        self.rounds += 1
        self.plan_rounds[plan.label] += 1
        self.budget_total += plan.budget

    def stats(
        self, policy: str, overlap: bool, steering: bool, budget: int, tree_method: str, generated: int, verifier_state: bool = False
    ) -> coordinator_pb2.RoundStats:
        total_ms = (time.perf_counter() - self.started) * 1e3
        return coordinator_pb2.RoundStats(
            rounds=self.rounds,
            mean_accepted_per_round=self.accepted / self.speculative_rounds if self.speculative_rounds else 0.0,
            draft_compute_ms=self.draft_compute_ms,
            verify_compute_ms=self.verify_compute_ms,
            wire_serialization_ms=self.draft_wire_ms + self.verify_wire_ms,
            serialization_ms=self.serialization_ms,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            speculation_budget=budget,
            total_ms=total_ms,
            first_token_ms=self.first_token_ms,
            generated_tokens=generated,
            tokens_per_second=generated / (total_ms / 1e3) if total_ms > 0 else 0.0,
            accepted_draft_tokens=self.accepted,
            drafted_tokens=self.drafted,
            tree_method=tree_method if budget else "",
            bytes_per_round=(self.bytes_sent + self.bytes_received) / self.rounds if self.rounds else 0.0,
            draft_wire_ms=self.draft_wire_ms,
            verify_wire_ms=self.verify_wire_ms,
            policy=policy,
            mean_budget=self.budget_total / self.rounds if self.rounds else 0.0,
            plan_rounds=dict(self.plan_rounds),
            overlap=overlap,
            overlap_hits=self.overlap_hits,
            steering=steering,
            steering_bytes=self.steering_bytes,
            verify_steering_ms=self.verify_steering_ms,
            draft_steering_ms=self.draft_steering_ms,
            verifier_state=verifier_state,
            verifier_state_bytes=self.verifier_state_bytes,
            drafter_failures=self.drafter_failures,
            draft_forward_passes=self.draft_forward_passes,
            draft_own_tokens=self.draft_own_tokens,
            draft_reencode_rollbacks=self.draft_reencode_rollbacks,
            draft_mapping_ms=self.draft_mapping_ms,
            speculative_rounds=self.speculative_rounds,
            # Rounds accepting the draft token at depth d + 1: those that accepted more than d.
            accepted_per_position=[
                sum(count for accepted, count in self.accepted_counts.items() if accepted > d)
                for d in range(max(self.accepted_counts, default=0))
            ],
            speculative_anatomy=self.speculative_anatomy.means(),
            verifier_alone_anatomy=self.verifier_alone_anatomy.means(),
            grammar_compile_ms=self.grammar_compile_ms,
            grammar_mask_ms=self.grammar_mask_ms,
            grammar_draft_ms=self.grammar_draft_ms,
            forced_tokens=self.forced,
            accepted_forced_tokens=self.accepted_forced,
        )


class RoundPolicy(Protocol):
    """Picks each round's plan and hears back what the round cost (FixedPolicy, BudgetController)."""

    def choose(self) -> Plan: ...

    def observe(self, report: RoundReport) -> None: ...


class FixedPolicy:
    """The same plan every round."""

    def __init__(self, plan: Plan):
        self.plan = plan

    def choose(self) -> Plan:
        return self.plan

    def observe(self, report: RoundReport) -> None:
        pass


def decode_rounds(
    session: PairSession,
    policy: RoundPolicy,
    shape: TreeShape,
    fused_block: int,
    max_new_tokens: int,
    meter: Meter,
    costs: VerifyCosts,
    overlap: ThreadPoolExecutor | None = None,
    forced_drafts: bool = False,
    blocks: EmptyDraftBlocks | None = None,
) -> Iterator[tuple[list[int], RoundReport]]:
    """Yields each round's newly committed tokens (accepted drafts, then the verifier's own
    token) and its report until max_new_tokens are out; the caller stops early on EOS or a stop string.
    The policy picks each round's plan: draft tree nodes and method (shaped by `shape`), or
    budget 0 for the verifier alone; it hears back what the round cost. With `overlap`
    (a thread pool for the verify calls), the drafter drafts the next round while the
    verifier checks this one, guessing the likeliest outcome (`overlap_guess`); when it came
    true, the next round starts without waiting for the drafter. A draft whose nodes carry
    confidences is cut to the nodes worth their verify cost (`costs`, measured every round).
    `forced_drafts` (a constrained request that speculates): the tokens its grammar forces are
    drafted too, before a drafter's draft and within the verifier's fused generation. Where a
    draft proposes nothing (an n-gram drafter without a match) the drafter is asked again after
    a token, or after as many as `blocks` finds worth it. A request's first round that the
    verifier runs alone generates one token: it streams as soon as the prompt is read, where a
    block would hold it back for the block's other tokens (~0.5 s on the 1.5B coder)."""
    rounds = _Rounds(session, shape, meter, costs, overlap, forced_drafts)
    generated, block = 0, 0  # block: the verifier's tokens since a draft that proposed nothing
    while generated < max_new_tokens:
        remaining = max_new_tokens - generated
        drafted, plan = rounds.draft(rounds.plan(policy), remaining)
        found = drafted is not None and bool(drafted.draft.tree.token_ids)
        if blocks is not None and drafted is not None and block:
            blocks.asked(block, found)
        if found:
            report, verdict, verify_call = rounds.verify_draft(plan, drafted)
        else:  # the verifier alone: by plan, with nothing drafted, or without a drafter
            if not generated:
                fused = 1
            elif drafted is None:
                fused = fused_block
            else:  # nothing to propose (an n-gram drafter without a match): ask again after a token, or a block
                fused = blocks.length() if blocks is not None else 1
            report, verdict, verify_call = rounds.verify_alone(plan, min(fused, remaining), drafted)
        rounds.account(policy, report, drafted, verify_call)
        if blocks is not None:
            blocks.costs.observe(report)
        block = len(verdict.token_ids) if not found and drafted is not None else 0
        if verdict.token_ids and not generated:
            meter.first_token_ms = (time.perf_counter() - meter.started) * 1e3
        generated += len(verdict.token_ids)
        yield list(verdict.token_ids), report


@dataclass
class _Drafted:
    draft: object  # the DraftResponse
    call: object  # its ServiceCall
    shape: TreeShape  # the round's tree shape (the next overlapped draft takes it too)
    exposed_draft_ms: float  # what the round waited for: 0 for a draft made while the last round was verified
    exposed_wire_ms: float
    forced: set[int] = field(default_factory=set)  # the tree's nodes the request's constraint forced


@dataclass
class _Carried:
    """What a round leaves to the next, by the concern that keeps it."""

    began: float  # timing: the round's start, the last one's end (what the caller does between rounds counts)
    ahead: tuple[object, object, Plan] | None = None  # overlap: a draft made for the next round, its call and plan
    deferred: Plan | None = None  # state deferral: a plan that waits one round for the drafter's verifier state
    folded: bool = False  # state deferral: the last round only fetched verifier state; its time is part of this one's


class _Rounds:
    """One round's steps (plan, draft, verify, account) over the state rounds carry
    (`carried`) and the drafter's standby after failures."""

    def __init__(
        self, session: PairSession, shape: TreeShape, meter: Meter, costs: VerifyCosts, overlap: ThreadPoolExecutor | None,
        forced_drafts: bool = False,
    ):
        self.session, self.shape, self.meter, self.costs, self.overlap = session, shape, meter, costs, overlap
        self.forced_drafts = forced_drafts
        self.standby = DrafterStandby(meter)
        self.carried = _Carried(began=time.perf_counter())

    def plan(self, policy: RoundPolicy) -> Plan:
        """The plan a round that fetched verifier state deferred, else the policy's choice."""
        plan, self.carried.deferred = self.carried.deferred or policy.choose(), None
        return plan

    # Forced tokens drafted at most a round: a whole JSON key with its quotes is ~5.
    MAX_FORCED = 32

    def draft(self, plan: Plan, remaining: int) -> tuple[_Drafted | None, Plan]:
        """This round's draft (None: the plan drafts none, or the drafter cannot now) and its
        plan: an overlapped draft ready from the last round brings the plan it was made for.
        Under a constraint the draft starts with the tokens it forces (drafted by no model) and
        keeps only the nodes it allows."""
        started = time.perf_counter()
        forced = self.session.forced(min(remaining - 1, self.MAX_FORCED)) if self.forced_drafts else []
        self.meter.grammar_draft_ms += (time.perf_counter() - started) * 1e3
        depth = min(self.shape.max_depth or plan.budget, remaining - 1 - len(forced))  # the verifier always adds one token
        if not (plan.budget and depth > 0 and self.session.can_draft and self.standby.ready()):
            return None, plan  # a constrained fused round verifies forced tokens in the verifier
        # A depth the request left open stays the tree builder's choice (a lattice drafts half
        # its budget deep) unless the tokens left cap it.
        round_depth = 0 if not self.shape.max_depth and plan.budget <= remaining - 1 - len(forced) else depth
        shape = replace(self.shape, method=plan.method, max_depth=round_depth, ngram=plan.ngram or self.shape.ngram)
        if self.carried.ahead is not None:  # its guess came true: this round's draft is ready
            (draft, call, plan), self.carried.ahead = self.carried.ahead, None
            drafted = _Drafted(draft, call, shape, 0.0, 0.0)
            self.meter.overlap_hits += 1
            forced = []  # drafted before the tokens it forces were known: it is only pruned
        else:
            draft, call = self.standby.draft(self.session, plan.budget, shape, forced=forced)
            if draft is None:
                return None, plan
            self.meter.add_call(call, is_draft=True)
            drafted = _Drafted(draft, call, shape, call.compute_ms, call.overhead_ms)
        if self.session.grammar is not None:
            drafted.draft, drafted.forced = self._constrained(drafted.draft, forced, remaining - 1)
        if drafted.draft.confidence:
            drafted.draft = _worth_verifying(drafted.draft, self.costs)
        return drafted, plan

    def _constrained(self, draft, forced: list[int], max_depth: int) -> tuple[object, set[int]]:
        """The draft (made after the forced tokens) as the verifier gets it under the constraint
        (specdec/core/grammar.py constrain_draft), no deeper than `max_depth`, and which of its
        nodes the grammar forced (confident: only their tokenization may differ)."""
        started = time.perf_counter()
        made = constrain_draft(tree_from_proto(draft.tree), self.session.grammar, forced, max_depth)
        constrained = drafter_pb2.DraftResponse()
        constrained.CopyFrom(draft)
        constrained.tree.CopyFrom(tree_to_proto(made.tree))
        del constrained.confidence[:]
        if draft.confidence:
            leaf = [draft.confidence[made.kept[-1]]] if made.kept else []
            constrained.confidence.extend([1.0] * len(forced) + [draft.confidence[n] for n in made.kept] + leaf * made.tail)
        self.meter.grammar_draft_ms += (time.perf_counter() - started) * 1e3
        return constrained, made.forced

    def verify_alone(self, plan: Plan, fused: int, empty: _Drafted | None = None):
        """`fused` tokens from the verifier alone; (report, verdict, call). A drafter that reads
        verifier state (a feature head) drafts after that of every committed position: where the
        plan drafts and it is missing, one verifier token brings it, and the plan runs next round.
        `empty`: the round's draft, which proposed nothing: its cost is the round's."""
        self.carried.ahead = None
        fetch = bool(plan.budget) and not self.session.can_draft and self.standby.ready()
        if fetch:
            fused, self.carried.deferred = 1, plan
        verdict, call = self.session.verify(None, fused_tokens=fused, verifier_state=fetch, forced_drafts=self.forced_drafts)
        # The grammar's drafts within the verifier count as drafts (not as speculative rounds).
        self.meter.forced += verdict.forced_drafted
        self.meter.accepted_forced += verdict.forced_accepted
        self.meter.drafted += verdict.forced_drafted
        self.meter.accepted += verdict.forced_accepted
        passes = len(verdict.token_ids) - verdict.forced_accepted  # each pass kept its forced tokens and one of its own
        report = RoundReport(
            plan=Plan(0), accepted=0, depth=0, verified_tokens=passes, draft_ms=empty.exposed_draft_ms if empty else 0.0,
            verify_ms=call.compute_ms, draft_wire_ms=empty.exposed_wire_ms if empty else 0.0, verify_wire_ms=call.overhead_ms,
            opened=call.opened or bool(empty and empty.call.opened), batch_rows=verdict.batch_rows, batch_sessions=verdict.batch_sessions,
            drafted_nothing=plan if empty else None,
        )
        if not report.opened:
            self.costs.observe(1, call.compute_ms, call.overhead_ms, generated=passes)
        return report, verdict, call

    def verify_draft(self, plan: Plan, drafted: _Drafted):
        """The draft verified; with overlap the next round's draft is made meanwhile, assuming
        the likeliest outcome, and kept where that came true. (report, verdict, call)."""
        session, meter, tree = self.session, self.meter, drafted.draft.tree
        structure = DraftTree(list(tree.token_ids), list(tree.parent))  # parents only: no proposals needed here
        if self.overlap is None:
            verdict, call = session.verify(tree, verifier_state=True)
        else:
            context_length = len(session.context)
            verifying = self.overlap.submit(session.verify, tree, 0, True)
            assumed, excludes = overlap_guess(structure, meter.accepted_counts)
            next_draft, next_call = self.standby.draft(session, plan.budget, drafted.shape, assumed, context_length, excludes)
            verdict, call = verifying.result()
            if next_draft is not None:
                meter.add_call(next_call, is_draft=True)
                hit = list(next_draft.assumed_token_ids) == list(verdict.token_ids)
                self.carried.ahead = (next_draft, next_call, plan) if hit else None
        nodes = len(structure)
        report = RoundReport(
            plan=plan, accepted=verdict.num_accepted_draft_tokens, depth=max(structure.depths(), default=0), verified_tokens=1 + nodes,
            draft_ms=drafted.exposed_draft_ms, verify_ms=call.compute_ms, draft_wire_ms=drafted.exposed_wire_ms,
            verify_wire_ms=call.overhead_ms, opened=call.opened or drafted.call.opened,
            batch_rows=verdict.batch_rows, batch_sessions=verdict.batch_sessions,
        )
        if not call.opened:
            self.costs.observe(1 + nodes, call.compute_ms, call.overhead_ms)
        meter.speculative_rounds += 1
        meter.accepted += verdict.num_accepted_draft_tokens
        meter.accepted_counts[verdict.num_accepted_draft_tokens] += 1
        meter.drafted += nodes
        meter.forced += len(drafted.forced)
        if drafted.forced:
            accepted = _accepted_nodes(structure, verdict.token_ids[: verdict.num_accepted_draft_tokens])
            report.accepted_forced = len(drafted.forced & set(accepted))
            meter.accepted_forced += report.accepted_forced
        return report, verdict, call

    def account(self, policy: RoundPolicy, report: RoundReport, drafted: _Drafted | None, verify_call) -> None:
        """The round's wall time, told to the policy and the anatomy. A round that fetched
        verifier state is part of the cost of the plan that needed it, next round (but not one
        that read the prompt: a request's first round is no plan's cost)."""
        carried, ended = self.carried, time.perf_counter()
        fetched_state = carried.deferred is not None
        report.wall_ms = (ended - carried.began) * 1e3
        if not fetched_state or report.opened:
            carried.began = ended
            # The policy prices its plans by the drafter's tokens: forced ones come whatever the plan.
            forced = len(drafted.forced) if drafted is not None else 0
            own = report.accepted - report.accepted_forced
            policy.observe(replace(report, accepted=own, depth=max(report.depth - forced, own)))
            if not (report.opened or carried.folded):  # the anatomy counts rounds that are only themselves
                anatomy = self.meter.verifier_alone_anatomy if report.plan.budget == 0 else self.meter.speculative_anatomy
                anatomy.add(report, None if drafted is None else drafted.call, verify_call)
        carried.folded = fetched_state and not report.opened  # this round's time goes into the next one's
        self.meter.add_call(verify_call, is_draft=False)
        self.meter.add_plan(report.plan)


def _worth_verifying(draft, costs: VerifyCosts):
    """The draft with only the nodes worth their measured verify cost (all of them until the
    costs are known); its tree is empty when the verifier's own token alone is worth more."""
    if costs.round_ms(1) is None or len(draft.confidence) != len(draft.tree.token_ids):
        return draft
    kept = goodput_cut(list(draft.tree.parent), list(draft.confidence), costs.round_ms)
    if len(kept) == len(draft.tree.token_ids):
        return draft
    index = {-1: -1} | {old: new for new, old in enumerate(kept)}
    cut = type(draft)()
    cut.CopyFrom(draft)
    cut.tree.CopyFrom(
        common_pb2.DraftTree(token_ids=[draft.tree.token_ids[n] for n in kept], parent=[index[draft.tree.parent[n]] for n in kept])
    )
    del cut.confidence[:]
    cut.confidence.extend(draft.confidence[n] for n in kept)
    return cut


class DrafterStandby:
    """A request outlives its drafter: after a failed Draft call (the drafter killed, restarting,
    overloaded or timing out) the rounds go on with the verifier alone, exactly, and the drafter
    is tried again after 2, 4, 8, ... up to 32 rounds; one success resets the wait."""

    MAX_WAIT_ROUNDS = 32

    def __init__(self, meter: Meter):
        self.meter = meter
        self.streak = 0
        self.next_try = 0

    def ready(self) -> bool:
        return self.meter.rounds >= self.next_try

    def draft(self, session: PairSession, *args, **kwargs):
        """session.draft(*args, **kwargs), or (None, None) when the drafter failed."""
        try:
            result = session.draft(*args, **kwargs)
        except grpc.RpcError as err:
            self.streak += 1
            self.meter.drafter_failures += 1
            self.next_try = self.meter.rounds + min(2**self.streak, self.MAX_WAIT_ROUNDS)
            log.warning("drafter call failed (%s: %s); the verifier goes on alone for now", err.code().name, err.details())
            return None, None
        self.streak = 0
        return result


def _accepted_nodes(tree: DraftTree, tokens: list[int]) -> list[int]:
    """The nodes the accepted tokens walk down, from the root."""
    path, node = [], ROOT
    for token in tokens:
        node = next((c for c in tree.children(node) if tree.token_ids[c] == token), None)
        if node is None:
            break
        path.append(node)
    return path


def overlap_guess(tree: DraftTree, accepted_counts: Counter) -> tuple[list[int], list[int]]:
    """What to draft the next round after, while this one is verified: the drafter's first
    choices (each node's first child) up to the likeliest number of accepted tokens, by this
    request's rounds so far (all of them until there are some; ties go deeper), and, when that
    number stops short of the path, the tokens the verifier's correction cannot be (the
    children it rejected there). Returns (assumed tokens, excluded picks)."""
    path, children = [], tree.children(ROOT)
    while children:
        path.append(children[0])
        children = tree.children(children[0])
    full = sum(count for accepted, count in accepted_counts.items() if accepted >= len(path))
    chances = [accepted_counts[j] for j in range(len(path))] + [full]
    stop = max(range(len(path) + 1), key=lambda j: (chances[j], j))
    assumed = [tree.token_ids[node] for node in path[:stop]]
    if stop == len(path):
        return assumed, []
    return assumed, [tree.token_ids[child] for child in tree.children(path[stop - 1] if stop else ROOT)]
