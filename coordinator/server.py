"""The client-facing Coordinator service: request validation, prompt preparation, and the
round loop driven once per request (streamed or not)."""
from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc

from coordinator.budget import AskCosts, BudgetController, EmptyDraftBlocks, Plan, RoundReport, VerifyCosts
from coordinator.clients import PairSession, Replicas, ServicePair
from coordinator.decoding import FixedPolicy, Meter, decode_rounds
from coordinator.output import OutputTracker
from specdec.core.grammar import ConstraintError, GrammarState, Grammars, constraint_from_proto
from specdec.core.models import load_tokenizer
from specdec.core.prompts import chat_ids
from specdec.core.sampling import validate_sampling
from specdec.core.tree import TreeShape
from specdec.serving.config import CoordinatorConfig, LimitsConfig, TlsConfig
from specdec.serving.latency_proxy import LatencyProxy
from specdec.serving.rpc import (
    BearerTokenAuth,
    MeasuredClient,
    ServiceError,
    invalid,
    reports_errors,
    set_serving,
    start_server,
)
from specdec.serving.wire import (
    COORDINATOR_SERVICE,
    DRAFTER_SERVICE,
    VERIFIER_SERVICE,
    shape_from_proto,
)
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    """How one request is decoded: its own fields, or the server's defaults where unset."""

    max_new_tokens: int
    budget: int  # draft tree nodes per round (0 = the verifier alone)
    tree: TreeShape
    adaptive: bool
    overlap: bool
    steering: bool


class Coordinator:
    """Runs requests over a drafter/verifier pair."""

    def __init__(self, config: CoordinatorConfig, limits: LimitsConfig, pair: ServicePair, tokenizer_source: str, on_finished=None):
        self.config = config
        self.limits = limits
        self.on_finished = on_finished  # called with each finished request's RoundStats (metrics)
        self.pair = pair
        self.tokenizer = load_tokenizer(tokenizer_source)
        info = pair.verifier_info
        self.eos_ids = set(info.eos_token_ids)
        self.vocab_size = info.vocab_size
        self.max_context = info.max_context
        # No token spans more characters than the longest in the vocabulary, so a text prompt
        # longer than this cannot fit the context: refused before it is tokenized.
        self.max_prompt_chars = self.max_context * max(len(t) for t in self.tokenizer.get_vocab())
        self.steering_problem = pair.steering_problem()  # None = the pair can steer; fixed at start
        self.grammars = Grammars(self.tokenizer, self.vocab_size, sorted(self.eos_ids), limits.max_constraint_bytes)
        adaptive = config.adaptive
        plans = [Plan(0)] + [Plan(b) for b in adaptive.chain_budgets] + [Plan(b, adaptive.tree_method) for b in adaptive.tree_budgets]
        plans += [Plan(b, "chain", adaptive.hybrid_ngram) for b in adaptive.hybrid_budgets]
        # Greedy and sampled decoding accept differently, and overlap hides the drafter's
        # cost: one cost model for each combination.
        self.verify_costs = VerifyCosts()  # what the verifier's calls cost, by size: n-gram drafts are cut to it
        # What asking the drafter costs: adaptive requests size the verifier's blocks after empty drafts by it.
        self.ask_costs = AskCosts(self.verify_costs)
        self.in_flight = 0  # requests holding a slot: the load the controllers price
        self.controllers = {
            (greedy, overlap): BudgetController(plans, config.fused_block_tokens, adaptive.revisit_every, lambda: self.in_flight)
            for greedy in (True, False)
            for overlap in (True, False)
        }
        self.verify_pool = ThreadPoolExecutor(max_workers=limits.max_concurrent_requests, thread_name_prefix="verify")
        self.largest_budget = max(p.budget for p in plans)
        self.slots = threading.BoundedSemaphore(limits.max_concurrent_requests)
        self.in_flight_lock = threading.Lock()

    @contextmanager
    def slot(self, context=None):
        """One of max_concurrent_requests; past them RESOURCE_EXHAUSTED at once, not a queue.
        A call that ends early (cancelled, its client gone) frees its slot at once, before
        its last round finishes: the client's next request must find it free."""
        if not self.slots.acquire(blocking=False):
            limit = self.limits.max_concurrent_requests
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the coordinator is serving its limit of {limit} requests; retry later")
        once = threading.Lock()  # whoever takes it first gives the slot back
        with self.in_flight_lock:
            self.in_flight += 1

        def release() -> None:
            if once.acquire(blocking=False):
                with self.in_flight_lock:
                    self.in_flight -= 1
                self.slots.release()

        if context is not None and hasattr(context, "add_callback"):
            context.add_callback(release)
        try:
            yield
        finally:
            release()

    def prompt_ids(self, request: coordinator_pb2.GenerateRequest) -> list[int]:
        if request.prompt and request.prompt_token_ids:
            raise invalid("set only one of prompt and prompt_token_ids")
        if request.prompt_token_ids:
            if request.use_chat_template:
                raise invalid("use_chat_template applies to a text prompt, not to prompt_token_ids")
            ids = list(request.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise invalid(f"prompt_token_ids has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        elif request.prompt:
            if len(request.prompt) > self.max_prompt_chars:
                raise invalid(
                    f"the prompt has {len(request.prompt)} characters, more than the verifier's context of {self.max_context} "
                    "tokens can hold"
                )
            if request.use_chat_template:
                if not self.tokenizer.chat_template:
                    raise invalid("use_chat_template: the verifier's tokenizer has no chat template")
                ids = chat_ids(self.tokenizer, request.prompt)
            else:
                ids = self.tokenizer(request.prompt, add_special_tokens=True)["input_ids"]
            if not ids:  # whitespace alone: no session can open on it
                raise invalid("the prompt has no tokens (it is whitespace)")
        else:
            raise invalid("the prompt is empty: set prompt or prompt_token_ids")
        if len(ids) >= self.max_context:
            raise invalid(f"the prompt has {len(ids)} tokens; the verifier's context is {self.max_context}")
        return list(ids)

    def grammar(self, request: coordinator_pb2.GenerateRequest) -> tuple[GrammarState | None, float]:
        """The request's constraint compiled (a fresh state of its grammar), and the ms that took
        (0 when cached); (None, 0) without one."""
        if not request.HasField("constraint") or request.constraint.WhichOneof("kind") is None:
            return None, 0.0
        try:
            return self.grammars.state(constraint_from_proto(request.constraint))
        except ConstraintError as err:
            raise invalid(f"constraint: {err}") from None

    def check_request(self, request: coordinator_pb2.GenerateRequest) -> Settings:
        """Validates the generation parameters; returns them with the server's defaults filled in."""
        limits = self.limits
        cap = limits.max_new_tokens
        max_new = request.max_new_tokens if request.HasField("max_new_tokens") else self.config.default_max_new_tokens
        if not 1 <= max_new <= cap:
            raise invalid(f"max_new_tokens must be in [1, {cap}], got {max_new}")
        top_p = request.top_p if request.HasField("top_p") else 1.0
        try:
            validate_sampling(request.temperature, top_p, request.top_k)
        except ValueError as err:
            raise invalid(str(err)) from None
        if any(not s for s in request.stop):
            raise invalid("stop strings must not be empty")
        if len(request.stop) > limits.max_stop_strings:
            raise invalid(f"{len(request.stop)} stop strings; at most {limits.max_stop_strings}")
        if any(len(s) > limits.max_stop_string_chars for s in request.stop):
            raise invalid(f"a stop string is longer than {limits.max_stop_string_chars} characters")
        budget = request.num_draft_tokens if request.HasField("num_draft_tokens") else self.config.num_draft_tokens
        if not 0 <= budget <= limits.max_draft_tokens:
            raise invalid(f"num_draft_tokens must be in [0, {limits.max_draft_tokens}] (0 = verifier only), got {budget}")
        try:
            shape = shape_from_proto(request.tree) if request.HasField("tree") else self.config.tree
            shape.check_limit(limits.max_draft_tokens)
        except ValueError as err:
            raise invalid(f"tree: {err}") from None
        if shape.ngram == "none" and not self.pair.drafter_info.num_layers:
            raise invalid("tree.ngram none asks for a drafter model's drafts; this drafter has no model (it drafts n-grams only)")
        # A request that names its plan runs it; the others get the server's default.
        names_plan = request.HasField("num_draft_tokens") or request.HasField("tree")
        adaptive = request.adaptive if request.HasField("adaptive") else self.config.adaptive.enabled and not names_plan
        overlap = request.overlap if request.HasField("overlap") else self.config.overlap
        if request.HasField("steering"):
            steering = request.steering
            if steering and self.steering_problem:
                raise invalid(self.steering_problem)
        else:  # the server's default, where the pair can steer
            steering = self.config.steering and self.steering_problem is None
        # With the verifier alone there is no drafter to steer.
        return Settings(max_new, budget, shape, adaptive, overlap, steering and (adaptive or budget > 0))

    def generate(
        self, request: coordinator_pb2.GenerateRequest, deadline: float | None = None, alive: Callable[[], bool] = lambda: True,
        on_end: Callable[[Callable[[], None]], object] | None = None,
    ) -> Iterator[coordinator_pb2.GenerateResponse]:
        """One response per round with the new tokens and text; the last has finish_reason and
        stats. Every internal call gets what is left before `deadline` (time.monotonic()); the
        rounds stop once `alive()` is false (the client went away), and both sides are freed.
        `on_end(fn)` has fn called when the call ends (gRPC's add_callback): a cancelled stream's
        generator may never be resumed, so its sessions are freed from there too."""
        settings = self.check_request(request)
        budget, adaptive, overlap = settings.budget, settings.adaptive, settings.overlap
        prompt = self.prompt_ids(request)
        grammar, compile_ms = self.grammar(request)
        max_new = min(settings.max_new_tokens, self.max_context - len(prompt) - max(budget, self.largest_budget if adaptive else 0) - 1)
        sampling = common_pb2.SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p if request.HasField("top_p") else 1.0,
            top_k=request.top_k,
            seed=request.seed,
        )
        verifier_state = self.pair.verifier_state and (adaptive or budget > 0)
        session = PairSession(
            self.pair, uuid.uuid4().hex, sampling, prompt, settings.steering, verifier_state, deadline,
            constraint=request.constraint if grammar is not None else None, grammar=grammar,
        )
        if on_end is not None:
            on_end(session.close)
        output = OutputTracker(self.tokenizer, self.eos_ids, list(request.stop), max_new)
        meter = Meter(grammar_compile_ms=compile_ms)
        try:
            policy = self.controllers[request.temperature == 0, overlap] if adaptive else FixedPolicy(Plan(budget, settings.tree.method))
            pool = self.verify_pool if overlap else None
            rounds = []  # of the message being made
            for committed, report in decode_rounds(
                session, policy, settings.tree, self.config.fused_block_tokens, max_new, meter, self.verify_costs, pool,
                forced_drafts=grammar is not None and (adaptive or budget > 0),  # budget 0 asks for the verifier alone
                blocks=EmptyDraftBlocks(self.ask_costs, self.config.fused_block_tokens) if adaptive else None,
            ):
                kept = output.add(committed, report.accepted)
                rounds.append(_round_info(report, kept))
                if output.finish_reason:
                    break
                if not alive():
                    return
                yield _message(*output.take_delta(), rounds)
                rounds = []
            output.end("length")
        finally:
            session.close()
        stats = meter.stats(
            "adaptive" if adaptive else "fixed", overlap, settings.steering, budget, settings.tree.method, len(output.token_ids),
            verifier_state,
        )
        stats.drafter_replica, stats.verifier_replica = session.replica("drafter"), session.replica("verifier")
        stats.replica_moves, stats.session_reopens = session.replica_moves, session.reopens
        if self.on_finished is not None:
            try:
                self.on_finished(stats)
            except Exception:  # metrics must never cost a client its answer
                log.exception("recording the request's metrics failed")
        last = _message(*output.take_delta(), rounds)
        last.finish_reason = output.finish_reason
        last.stats.CopyFrom(stats)
        yield last


def _message(tokens: list[int], text: str, spans: list[tuple[int, int, bool]], rounds: list) -> coordinator_pb2.GenerateResponse:
    return coordinator_pb2.GenerateResponse(
        text=text, token_ids=tokens, rounds=rounds,
        spans=[coordinator_pb2.TextSpan(chars=chars, tokens=count, drafted=drafted) for chars, count, drafted in spans],
    )


def _round_info(report: RoundReport, kept: int) -> coordinator_pb2.RoundInfo:
    return coordinator_pb2.RoundInfo(
        plan=report.plan.label, drafted_tokens=report.verified_tokens - 1 if report.plan.budget else 0,
        accepted_draft_tokens=min(report.accepted, kept), tokens=kept, round_ms=report.wall_ms, draft_ms=report.draft_ms,
        verify_ms=report.verify_ms, wire_ms=report.draft_wire_ms + report.verify_wire_ms,
    )


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """The client API over one Coordinator; its own gRPC server and the calls that come
    through Ray Serve's proxies (coordinator/openai_api.py) share the coordinator's slots."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    @reports_errors
    def Generate(self, request, context):
        text, whole = [], coordinator_pb2.GenerateResponse()
        with self.coordinator.slot(context):
            for part in self.coordinator.generate(request, *_bounds(context)):
                text.append(part.text)
                whole.MergeFrom(part)  # appends tokens, spans and rounds; the last brings finish_reason and stats
        whole.text = "".join(text)
        return whole

    @reports_errors
    def GenerateStream(self, request, context):
        with self.coordinator.slot(context):
            for response in self.coordinator.generate(request, *_bounds(context)):
                if response.finish_reason:
                    break
                yield response
            else:
                return  # the client went away
        yield response  # the last, with the slot free again: the client may ask anew as soon as it has it


def _bounds(context) -> tuple[float | None, Callable[[], bool], Callable | None]:
    """The call's deadline (time.monotonic(); None = none), whether its client is still there,
    and how to be told when it ends."""
    left = context.time_remaining()
    return (None if left is None else time.monotonic() + left), context.is_active, getattr(context, "add_callback", None)


def serve(coordinator: Coordinator, host: str, port: int, tls: TlsConfig = TlsConfig()):
    """Starts the client API with the standard health service; returns (server, bound port).
    Each request holds a worker thread; a few more threads keep health checks and reflection
    answering when the requests are at their limit."""
    servicer = CoordinatorServicer(coordinator)
    tokens = coordinator.config.auth.accepted()
    server, bound, _ = start_server(
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
        host,
        port,
        max_workers=coordinator.limits.max_concurrent_requests + 4,
        health_service=COORDINATOR_SERVICE,
        interceptors=(BearerTokenAuth(COORDINATOR_SERVICE, tokens),) if tokens else (),
        tls=tls.read() if tls.enabled else None,
        max_message_bytes=int(coordinator.limits.max_request_mib * 2**20),
        max_calls=2 * coordinator.limits.max_concurrent_requests + 4,  # refused ones are answered by the slots, not queued
    )
    return server, bound


def start(config, drafter_address: str | None, verifier_address: str | None, on_finished=None, discover=None, local: dict | None = None):
    """Connects to both services, checks the pair, and starts the client API; returns
    (grpc server, bound port, coordinator). An address may list several replicas,
    comma-separated. `discover(name)` -> {replica id: address}: the replicas of "drafter" or
    "verifier" there are now (Ray Serve's replica directory); with it the addresses are not
    used. `local` = {"drafter" or "verifier": an in-process client}: a service that runs in
    this process instead (coordinator.drafter_in_process, coordinator.verifier_in_process).
    Health says NOT_SERVING while no verifier replica answers."""
    local = local or {}

    def replicas(name: str, address: str | None) -> Replicas:
        return Replicas.of(name, local[name]) if name in local else _replicas(config, name, address, discover)

    drafter, verifier = replicas("drafter", drafter_address), replicas("verifier", verifier_address)
    pair = ServicePair(drafter, verifier, config.coordinator.request_timeout_s)
    coordinator = Coordinator(config.coordinator, config.limits, pair, config.verifier.model.source, on_finished)
    if config.resolved_steering_checkpoint() and coordinator.steering_problem:
        log.warning("requests will not be steered: %s", coordinator.steering_problem)
    server, port = serve(coordinator, config.coordinator.host, config.coordinator.port, config.coordinator.tls)

    def verifier_reachable(ok: bool) -> None:
        for service in ("", COORDINATOR_SERVICE):
            set_serving(server, service, ok)

    pair.watch(verifier_reachable)
    return server, port, coordinator


def _replicas(config, name: str, addresses: str | None, discover) -> Replicas:
    """The service's replicas, each dialed directly or through the emulated link of its kind."""
    link = getattr(config.coordinator.network, name)
    service = DRAFTER_SERVICE if name == "drafter" else VERIFIER_SERVICE
    token, max_bytes = config.coordinator.auth.service_token, int(config.limits.max_message_mib * 2**20)

    def connect(address: str) -> tuple[MeasuredClient, LatencyProxy | None]:
        proxy = LatencyProxy(address, link) if link.active else None
        return MeasuredClient(proxy.address if proxy else address, service, token, max_bytes, config.coordinator.service_tls), proxy

    find = functools.partial(discover, name) if discover is not None else None
    known = find() if find is not None else {address: address for address in addresses.split(",")}
    return Replicas(name, known, connect, find, linger_s=config.coordinator.request_timeout_s)
