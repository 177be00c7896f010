"""The coordinator's view of the two services: their replicas and which holds each session,
measured gRPC calls, session (re)opening, and retries of an idempotent round."""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import grpc

from specdec.core.grammar import GrammarState
from specdec.core.tree import TreeShape
from specdec.serving.rpc import CallCost, ServiceError
from specdec.serving.wire import shape_to_proto
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2

log = logging.getLogger(__name__)

# Codes after which a service has lost (or never had) the session: re-open with the context.
_REOPEN = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
# Codes worth the same round again: the replica is unreachable or slow, or it stopped and
# cancelled the call in flight (this side never cancels a call it still waits for).
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# EndSession calls in flight: held until they finish, since a dropped future may be cancelled.
_ending: set = set()
_ending_lock = threading.Lock()


class PairMismatch(RuntimeError):
    pass


@dataclass
class ServiceCall:
    """One measured call: the remote compute time and what the call cost around it."""

    compute_ms: float
    cost: CallCost
    steering_ms: float = 0.0  # of compute_ms, the service's steering work
    steering_bytes: int = 0  # steering vector bytes this call carried
    verifier_state_bytes: int = 0  # verifier state (for the drafter) bytes this call carried
    forward_passes: int = 0  # drafter model forwards this call ran
    own_tokens_drafted: int = 0  # a drafter of another tokenizer: DraftResponse's counters
    reencode_rollbacks: int = 0
    mapping_ms: float = 0.0
    grammar_ms: float = 0.0  # of compute_ms, the verifier's masking by the request's constraint
    opened: bool = False  # the call (re)opened the session: its compute includes reading the context
    handler_ms: float = 0.0  # the whole call inside the service, its compute included

    @property
    def in_service_ms(self) -> float:
        """Of the overhead, the time inside the service outside its compute: parsing, the
        session, the hand-off to its compute thread, building the reply."""
        return min(max(self.handler_ms - self.compute_ms, 0.0), self.overhead_ms)

    @property
    def overhead_ms(self) -> float:
        """Time of the call not spent computing in the service: wire plus (de)serialization."""
        return max(self.cost.total_ms - self.compute_ms, 0.0)


class Replicas:
    """The replicas of one service as this coordinator sees them, and which one holds each
    session. A new session goes to the replica holding the fewest of this coordinator's
    sessions (ties: the highest rendezvous hash of session and replica) and stays there, where
    its KV cache lives, until that replica leaves or stops answering; its next call then moves
    it to another, which re-opens it with the whole context.

    `connect(address)` -> (client, link or None): a client for a replica, and the emulated link
    in front of it, if any. `discover()` -> {replica id: address}: the replicas there are now
    (Ray Serve's replica directory), asked every few seconds and whenever a call fails; None =
    the replicas given are all there will ever be."""

    def __init__(
        self, name: str, replicas: dict[str, str], connect: Callable[[str], tuple], discover: Callable[[], dict[str, str]] | None = None,
        linger_s: float = 120.0,
    ):
        self.name = name
        self._connect, self._discover, self._linger_s = connect, discover, linger_s
        self._lock = threading.Lock()
        self._clients: dict[str, object] = {}
        self._addresses: dict[str, str] = {}
        self._links: dict[str, object] = {}
        self._down: set[str] = set()  # listed, but not answering: no new sessions, and sessions there move
        self._bound: dict[str, str] = {}  # session id -> replica id
        self._retired: list[tuple[float, object, object]] = []  # (when, client, link) of replicas gone
        self._update(replicas)
        if not self._clients:
            raise RuntimeError(f"no {name} replica to connect to")

    @classmethod
    def of(cls, name: str, client) -> "Replicas":
        """One replica reached through `client`, which may be in this process."""
        return cls(name, {client.address: client.address}, lambda _address: (client, None))

    def any_client(self):
        with self._lock:
            return next(iter(self._clients.values()))

    def bind(self, session_id: str) -> tuple[str, object]:
        """The replica holding the session (placing it if it has none, or moving it if its
        replica is gone or down) and a client for it."""
        with self._lock:
            key = self._bound.get(session_id)
            if key not in self._clients or (key in self._down and len(self._down) < len(self._clients)):
                up = [k for k in self._clients if k not in self._down] or list(self._clients)
                load = Counter(self._bound.values())
                key = min(up, key=lambda k: (load[k], -_rendezvous(session_id, k)))
                self._bound[session_id] = key
            return key, self._clients[key]

    def client_of(self, session_id: str):
        """The client of the replica holding the session, None when it holds none (any more)."""
        with self._lock:
            return self._clients.get(self._bound.get(session_id))

    def address(self, key: str) -> str:
        with self._lock:
            return self._addresses.get(key, "")

    def release(self, session_id: str) -> None:
        with self._lock:
            self._bound.pop(session_id, None)

    def failed(self, key: str) -> None:
        """A call to replica `key` could not reach it: learn who is there now, and mark it
        down if it is still listed but does not answer, so its sessions move."""
        self.refresh()
        with self._lock:
            client = self._clients.get(key)
        if client is not None and not client.reachable():
            with self._lock:
                self._down.add(key)

    def check(self) -> bool:
        """Re-reads the replicas and asks each whether it answers; True when one does."""
        self.refresh()
        with self._lock:
            clients = dict(self._clients)
        answering = {key for key, client in clients.items() if client.reachable()}
        with self._lock:
            self._down = set(clients) - answering
        return bool(answering)

    def refresh(self) -> None:
        if self._discover is None:
            return
        try:
            replicas = self._discover()
        except Exception as err:  # noqa: BLE001 - the directory is restarting: keep what we know
            log.info("could not list the %s replicas: %s", self.name, err)
            return
        if replicas:  # an empty list is a moment of no replica (a restart): keep dialing the last ones
            self._update(replicas)

    def _update(self, replicas: dict[str, str]) -> None:
        with self._lock:
            for key in [k for k in self._clients if replicas.get(k) != self._addresses[k]]:
                log.warning("%s replica %s at %s is gone", self.name, key, self._addresses[key])
                # Calls in flight on it finish (closing the channel would cancel them).
                self._retired.append((time.monotonic() + self._linger_s, self._clients.pop(key), self._links.pop(key, None)))
                self._down.discard(key)
                del self._addresses[key]
            for key, address in replicas.items():
                if key not in self._clients:
                    self._clients[key], link = self._connect(address)
                    self._addresses[key] = address
                    if link is not None:
                        self._links[key] = link
            now = time.monotonic()
            expired = [r for r in self._retired if r[0] <= now]
            self._retired = [r for r in self._retired if r[0] > now]
        for _, client, link in expired:
            _close(client, link)

    def close(self) -> None:
        with self._lock:
            everything = [(c, self._links.get(k)) for k, c in self._clients.items()] + [(c, link) for _, c, link in self._retired]
            self._clients, self._retired = {}, []
        for client, link in everything:
            _close(client, link)


def _close(client, link) -> None:
    client.close()
    if link is not None:
        link.close()


def _rendezvous(session_id: str, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session_id}|{key}".encode(), digest_size=8).digest(), "big")


class VerifierStateLog:
    """The verifier state of positions [0, positions) for a drafter that reads it, kept unread
    by position as the verifier sent it (records of one size), and how many positions of it the
    drafter holds. A re-opened verifier sends it again from where it restarted; the drafter is
    then sent it again too."""

    def __init__(self):
        self.records = bytearray()
        self.record_bytes = 0
        self.positions = 0
        self.drafter_holds = 0

    def add(self, state: common_pb2.VerifierState) -> None:
        size = len(state.records) // state.positions if state.positions else self.record_bytes
        if state.start > self.positions or size * state.positions != len(state.records) or self.record_bytes not in (0, size):
            raise RuntimeError(
                f"the verifier sent malformed verifier state (start {state.start}, {state.positions} positions, "
                f"{len(state.records)} bytes; {self.positions} positions of {self.record_bytes} bytes held)"
            )
        self.record_bytes = size
        del self.records[state.start * size :]
        self.records += state.records
        self.positions = state.start + state.positions
        self.drafter_holds = min(self.drafter_holds, state.start)

    def unsent(self, upto: int, reopen: bool) -> common_pb2.VerifierState | None:
        """The state of positions [0, upto) the drafter lacks (all of it for a re-opened drafter
        session), or None when it lacks none."""
        first = 0 if reopen else self.drafter_holds
        if upto <= first:
            return None
        return common_pb2.VerifierState(
            start=first, positions=upto - first, records=bytes(self.records[first * self.record_bytes : upto * self.record_bytes])
        )

    def delivered(self, upto: int) -> None:
        """The drafter now holds positions [0, upto)."""
        self.drafter_holds = max(self.drafter_holds, upto)


class ServicePair:
    def __init__(self, drafter: Replicas, verifier: Replicas, timeout_s: float = 120.0):
        """The drafter's and the verifier's replicas (the drafter's may be one in this process)."""
        self.drafter, self.verifier = drafter, verifier
        self._closed = threading.Event()
        self.timeout_s = timeout_s
        self.drafter_info, _ = drafter.any_client().call("Info", common_pb2.InfoRequest(), common_pb2.ModelInfo, timeout=timeout_s)
        self.verifier_info, _ = verifier.any_client().call("Info", common_pb2.InfoRequest(), common_pb2.ModelInfo, timeout=timeout_s)
        # A drafter without a model (n-gram) reports no tokenizer: it takes any token ids.
        if self.drafter_info.tokenizer_fingerprint and self.drafter_info.tokenizer_fingerprint != self.verifier_info.tokenizer_fingerprint:
            raise PairMismatch(
                f"mismatched tokenizers: drafter '{self.drafter_info.model}' and verifier '{self.verifier_info.model}' "
                "do not share one tokenizer, so the drafter's token ids mean nothing to the verifier; "
                "set drafter.tokenizer: own in the config to draft across tokenizers (the drafter maps its drafts through text)"
            )
        drafter, verifier = self.drafter_info, self.verifier_info
        # A drafter that reads verifier state (a feature head: the verifier's features) cannot
        # draft without it; the coordinator only carries it.
        self.verifier_state = bool(drafter.verifier_state)
        if self.verifier_state and drafter.verifier_state != verifier.verifier_state:
            raise PairMismatch(
                f"the drafter '{drafter.model}' reads verifier state '{drafter.verifier_state}', but the verifier "
                + (f"fills '{verifier.verifier_state}'" if verifier.verifier_state else "fills none")
                + "; start the verifier with the checkpoint the drafter's state comes from (for a feature head the config does so)"
            )

    def steering_problem(self) -> str | None:
        """Why this pair cannot steer, or None when it can."""
        drafter, verifier = self.drafter_info, self.verifier_info
        if not drafter.steering_size or not verifier.steering_size:
            missing = [name for name, info in (("drafter", drafter), ("verifier", verifier)) if not info.steering_size]
            return (
                f"steering needs a steering checkpoint loaded in both services; the {' and '.join(missing)} has none "
                "(the config's steering_checkpoint)"
            )
        if drafter.steering_fingerprint != verifier.steering_fingerprint or drafter.steering_size != verifier.steering_size:
            return "the drafter and the verifier loaded different steering checkpoints; both halves must come from one"
        return None

    def watch(self, on_verifier: Callable[[bool], None], every_s: float = 2.0) -> None:
        """Checks both services' replicas every `every_s` in a thread until the pair is closed,
        and tells `on_verifier` whether a verifier replica answers (without one no request can
        be served; without the drafter they go on alone)."""

        def run() -> None:
            while not self._closed.wait(every_s):
                self.drafter.check()
                on_verifier(self.verifier.check())

        threading.Thread(target=run, name="pair-watch", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self.drafter.close()
        self.verifier.close()


class PairSession:
    """One request's session on both services. Tracks what each side has seen, so a round sends
    only the new tokens, and re-opens a side with the full context if it lost the session."""

    # A verifier restarting gets 50 + 100 + ... + 800 ms; the drafter one quick retry, since the
    # request can go on without it (coordinator/decoding.py DrafterStandby).
    VERIFY_RETRIES, DRAFT_RETRIES, RETRY_BACKOFF_S = 5, 1, 0.05

    def __init__(
        self, pair: ServicePair, session_id: str, sampling: common_pb2.SamplingParams, context: list[int], steering: bool = False,
        verifier_state: bool = False, deadline: float | None = None, constraint: common_pb2.Constraint | None = None,
        grammar: GrammarState | None = None,
    ):
        self.pair = pair
        # Structured outputs: the constraint the verifier masks by, and where the committed output
        # stands in its grammar (the coordinator drafts what it forces and drops what it forbids).
        self.constraint, self.grammar = constraint, grammar
        self.deadline = deadline  # time.monotonic() by which the request must be answered; None = none
        self.session_id = session_id
        self.sampling = sampling
        self.context = list(context)
        self.prompt_length = len(context)
        self.steering = steering
        self.steering_vector: common_pb2.Tensor | None = None  # the verifier's latest, for the next draft
        self.verifier_state = verifier_state
        self._state_log = VerifierStateLog()
        self._drafter_seen: int | None = None  # context length the drafter has; None = not open
        self._drafter_round = 0
        self._verifier_round = 0
        self._verifier_open = False
        self._at: dict[str, str] = {}  # service -> the replica that last served the session
        self.replica_moves = 0  # calls that found the session's replica gone and re-opened it on another
        self.reopens = 0  # calls a service refused for a session it lost, re-sent with the whole context
        self._closed = False

    def draft(
        self, num_tokens: int, shape: TreeShape, assumed: list[int] = (), context_length: int | None = None,
        pick_excludes: list[int] = (), forced: list[int] = (),
    ) -> tuple[drafter_pb2.DraftResponse, ServiceCall]:
        """A draft after the committed context, or (overlapped drafting) after its first
        `context_length` tokens plus `assumed` ones and the drafter's pick of the next (not one
        of `pick_excludes`), while a verify call is in flight; after `forced` tokens (a
        constraint's) that follow all of those."""
        context = self.context[:context_length]
        steering = self.steering_vector  # the first round, before any vector exists, is unsteered
        state_positions = self._state_log.positions  # a verify call in flight may add more meanwhile
        sent_state = sent_round = 0

        def request(reopen: bool) -> drafter_pb2.DraftRequest:
            nonlocal sent_round
            sent_round = 1 if reopen else self._drafter_round + 1  # a retry sends the same number
            message = drafter_pb2.DraftRequest(
                session_id=self.session_id,
                round=sent_round,
                committed_length=len(context),
                num_draft_tokens=num_tokens,
                tree_shape=shape_to_proto(shape),
                assumed_token_ids=assumed,
                pick_excludes=pick_excludes,
                forced_token_ids=forced,
            )
            if steering is not None:
                message.steering.CopyFrom(steering)
            if reopen:
                message.start.CopyFrom(common_pb2.SessionStart(
                    context_token_ids=context, sampling=self.sampling, prompt_length=self.prompt_length, constraint=self.constraint,
                ))
                message.verifier_tokenizer_fingerprint = self.pair.verifier_info.tokenizer_fingerprint
            else:
                message.new_token_ids.extend(context[self._drafter_seen :])
            if self.verifier_state:
                nonlocal sent_state
                unsent = self._state_log.unsent(state_positions, reopen)
                if unsent is not None:
                    message.verifier_state.CopyFrom(unsent)
                sent_state = len(message.verifier_state.records)
            return message

        reply, call = self._call(
            self.pair.drafter, "Draft", drafter_pb2.DraftResponse, request, self._drafter_seen is None, self.DRAFT_RETRIES
        )
        self._drafter_seen, self._drafter_round = len(context), sent_round
        self._state_log.delivered(state_positions)
        call.steering_ms, call.steering_bytes = reply.steering_ms, len(steering.data) if steering is not None else 0
        call.verifier_state_bytes, call.forward_passes = sent_state, reply.forward_passes
        call.own_tokens_drafted, call.reencode_rollbacks = reply.own_tokens_drafted, reply.reencode_rollbacks
        call.mapping_ms = reply.mapping_ms
        return reply, call

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the request's constraint forces next; [] without one."""
        return self.grammar.forced(limit) if self.grammar is not None else []

    @property
    def can_draft(self) -> bool:
        """A drafter that reads verifier state drafts after that of every committed position but
        the last (a verify call that asks for it brings it up to date)."""
        return not self.verifier_state or self._state_log.positions >= len(self.context) - 1

    def verify(
        self, tree: common_pb2.DraftTree | None, fused_tokens: int = 0, verifier_state: bool = False, forced_drafts: bool = False,
    ) -> tuple[verifier_pb2.VerifyResponse, ServiceCall]:
        """One round on the verifier. `verifier_state`: bring the drafter's verifier state up to
        date (the verifier keeps it for such a session; a round whose next one will not draft
        needs none). `forced_drafts`: fused generation verifies the constraint's forced tokens."""
        def request(reopen: bool) -> verifier_pb2.VerifyRequest:
            if reopen:
                self._verifier_round = 0
            message = verifier_pb2.VerifyRequest(
                session_id=self.session_id, round=self._verifier_round + 1, fused_tokens=fused_tokens, steering=self.steering,
                verifier_state=self.verifier_state and verifier_state, forced_drafts=forced_drafts,
            )
            if tree is not None:
                message.tree.CopyFrom(tree)
            if reopen:
                message.start.CopyFrom(common_pb2.SessionStart(
                    context_token_ids=self.context, sampling=self.sampling, prompt_length=self.prompt_length,
                    keep_verifier_state=self.verifier_state, constraint=self.constraint,
                ))
            return message

        reply, call = self._call(
            self.pair.verifier, "Verify", verifier_pb2.VerifyResponse, request, not self._verifier_open, self.VERIFY_RETRIES
        )
        self._verifier_open = True
        self._verifier_round += 1
        self.context.extend(reply.token_ids)
        call.grammar_ms = reply.grammar_ms
        if self.grammar is not None:
            self.grammar.advance(reply.token_ids)
        if reply.HasField("steering"):
            self.steering_vector = reply.steering
            call.steering_ms, call.steering_bytes = reply.steering_ms, len(reply.steering.data)
        if reply.HasField("verifier_state"):
            self._state_log.add(reply.verifier_state)
            call.verifier_state_bytes = len(reply.verifier_state.records)
        return reply, call

    def close(self) -> None:
        """Frees the session on both sides without waiting for the answers; no call opens it
        again afterwards. Called from the request's end and from its RPC's end (a cancelled
        stream), whichever comes first."""
        if self._closed:
            return
        self._closed = True
        for replicas in (self.pair.drafter, self.pair.verifier):
            client = replicas.client_of(self.session_id)
            if client is not None:
                self._end(client)
            replicas.release(self.session_id)

    def replica(self, service: str) -> str:
        """The address of the replica that last served the session."""
        replicas = self.pair.drafter if service == "drafter" else self.pair.verifier
        key = self._at.get(service)
        return replicas.address(key) if key is not None else ""

    def _end(self, client) -> None:
        future = client.call_async("EndSession", common_pb2.EndSessionRequest(session_id=self.session_id))
        if future is not None:
            with _ending_lock:
                _ending.add(future)
            future.add_done_callback(_ended)

    def _timeout(self) -> float:
        """What a call may take: the pair's limit, within what is left of the request's deadline."""
        if self.deadline is None:
            return self.pair.timeout_s
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        return min(self.pair.timeout_s, left)

    def _call(self, replicas: Replicas, method: str, response_type, build, reopen: bool, max_retries: int):
        """The call on the replica holding the session, re-opening the session once if the
        service lost it or it moved to another replica, and retrying a replica that is
        unreachable or slow after 50, 100, 200, ... ms (at most `max_retries` times, within the
        request's deadline): the same round again, which no service commits twice."""
        backoff_s, retries, request, built = self.RETRY_BACKOFF_S, 0, None, None
        while True:
            if self._closed:
                raise ServiceError(grpc.StatusCode.CANCELLED, "the request ended")
            key, client = replicas.bind(self.session_id)
            before = self._at.get(replicas.name)
            if before is not None and before != key and not reopen:
                reopen = True
                self.replica_moves += 1
                log.info("session %s moves to %s replica %s", self.session_id, replicas.name, key)
            if built != (key, reopen):
                request, built = build(reopen), (key, reopen)
            try:
                reply, cost = client.call(method, request, response_type, timeout=self._timeout())
                self._at[replicas.name] = key
                if self._closed:  # closed meanwhile: this call may have (re)opened the session after EndSession
                    self._end(client)
                return reply, ServiceCall(reply.compute_ms, cost, opened=reopen, handler_ms=reply.handler_ms)
            except grpc.RpcError as err:
                if err.code() in _REOPEN and not reopen:
                    reopen = True
                    self.reopens += 1
                    continue
                transient = err.code() in _TRANSIENT
                out_of_time = self.deadline is not None and time.monotonic() + backoff_s > self.deadline
                if not transient or retries == max_retries or out_of_time:
                    if transient and replicas.name == "verifier":
                        # No request can go on without it; the caller learns that, not this side's addresses.
                        log.warning("verifier replica %s does not answer: %s %s", key, err.code().name, err.details())
                        raise ServiceError(
                            err.code(), f"no verifier replica answers ({retries} retries): the verifier is down or restarting; retry later"
                        ) from err
                    raise
                replicas.failed(key)
                time.sleep(backoff_s)
                backoff_s, retries = backoff_s * 2, retries + 1


def _ended(future) -> None:
    with _ending_lock:
        _ending.discard(future)
