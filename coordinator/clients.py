"""The coordinator's view of the two services: measured gRPC calls, session (re)opening and
one retry of an idempotent round."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from specdec.core.tree import TreeShape
from specdec.serving.rpc import (
    MAX_MESSAGE_BYTES,
    CallCost,
    InProcessClient,
    MeasuredClient,
    ServiceError,
)
from specdec.serving.wire import DRAFTER_SERVICE, VERIFIER_SERVICE, shape_to_proto
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2

log = logging.getLogger(__name__)

# Codes after which a service has lost (or never had) the session: re-open with the context.
_REOPEN = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
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
    feature_bytes: int = 0  # verifier feature bytes this call carried
    forward_passes: int = 0  # drafter model forwards this call ran
    opened: bool = False  # the call (re)opened the session: its compute includes reading the context

    @property
    def overhead_ms(self) -> float:
        """Time of the call not spent computing in the service: wire plus (de)serialization."""
        return max(self.cost.total_ms - self.compute_ms, 0.0)


class ServicePair:
    def __init__(
        self, drafter: str | InProcessClient, verifier_address: str, timeout_s: float = 120.0, proxies: dict | None = None,
        resolve: Callable[[str], str] | None = None, service_token: str = "", max_message_bytes: int = MAX_MESSAGE_BYTES,
    ):
        """`drafter`: the drafter's address, or a drafter running in this process. `proxies`:
        emulated links in front of the services by name ("drafter", "verifier"), closed with the
        pair. `resolve(name)`: where that service listens now (Ray Serve replicas bind a new port
        when restarted), asked again whenever it cannot be reached. `service_token`: what the
        services ask of their callers."""
        self.proxies = proxies or {}
        self.resolve = resolve
        if not isinstance(drafter, InProcessClient):
            drafter = MeasuredClient(drafter, DRAFTER_SERVICE, service_token, max_message_bytes)
        self.drafter = drafter
        self.verifier = MeasuredClient(verifier_address, VERIFIER_SERVICE, service_token, max_message_bytes)
        self._resolving = threading.Lock()
        self._closed = threading.Event()
        self.timeout_s = timeout_s
        self.drafter_info, _ = self.drafter.call("Info", common_pb2.InfoRequest(), common_pb2.ModelInfo, timeout=timeout_s)
        self.verifier_info, _ = self.verifier.call("Info", common_pb2.InfoRequest(), common_pb2.ModelInfo, timeout=timeout_s)
        # A drafter without a model (n-gram) reports no tokenizer: it takes any token ids.
        if self.drafter_info.tokenizer_fingerprint and self.drafter_info.tokenizer_fingerprint != self.verifier_info.tokenizer_fingerprint:
            raise PairMismatch(
                f"mismatched tokenizers: drafter '{self.drafter_info.model}' and verifier '{self.verifier_info.model}' "
                "do not share one tokenizer, so the drafter's token ids mean nothing to the verifier"
            )
        drafter, verifier = self.drafter_info, self.verifier_info
        # A feature head drafts from the verifier's features alone: without them it cannot draft.
        self.features = drafter.feature_size > 0
        if self.features and (drafter.feature_size, drafter.feature_fingerprint) != (verifier.feature_size, verifier.feature_fingerprint):
            raise PairMismatch(
                f"the drafter '{drafter.model}' is a feature head, but the verifier "
                + ("loaded no feature head checkpoint" if not verifier.feature_size else "loaded another feature head checkpoint")
                + "; start it with the drafter's directory as its feature_checkpoint (the config does this when the drafter is one)"
            )

    def steering_problem(self) -> str | None:
        """Why this pair cannot steer, or None when it can."""
        drafter, verifier = self.drafter_info, self.verifier_info
        if not drafter.steering_size or not verifier.steering_size:
            missing = [name for name, info in (("drafter", drafter), ("verifier", verifier)) if not info.steering_size]
            return f"steering needs a steering checkpoint loaded in both services; the {' and '.join(missing)} has none (the config's steering_checkpoint)"
        if drafter.steering_fingerprint != verifier.steering_fingerprint or drafter.steering_size != verifier.steering_size:
            return "the drafter and the verifier loaded different steering checkpoints; both halves must come from one"
        return None

    def reresolve(self, client) -> None:
        """Asks where the service behind `client` listens now and dials there if it moved."""
        if self.resolve is None or isinstance(client, InProcessClient):
            return
        name = "drafter" if client is self.drafter else "verifier"
        with self._resolving:
            try:
                address = self.resolve(name)
            except Exception as err:  # noqa: BLE001 - not known yet (restarting): the caller retries
                log.info("could not resolve the %s yet: %s", name, err)
                return
            if name in self.proxies:
                self.proxies[name].retarget(address)
            elif address != client.address:
                log.warning("the %s moved to %s", name, address)
                client.retarget(address)

    def watch(self, on_verifier: Callable[[bool], None], every_s: float = 2.0) -> None:
        """Checks both services every `every_s` in a thread until the pair is closed,
        re-resolving one that does not answer, and tells `on_verifier` whether the verifier is
        reachable (without it no request can be served; without the drafter they go on alone)."""

        def run() -> None:
            while not self._closed.wait(every_s):
                for client in (self.drafter, self.verifier):
                    ok = client.reachable()
                    if not ok:
                        self.reresolve(client)
                        ok = client.reachable()
                    if client is self.verifier:
                        on_verifier(ok)

        threading.Thread(target=run, name="pair-watch", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self.drafter.close()
        self.verifier.close()
        for proxy in self.proxies.values():
            proxy.close()


class PairSession:
    """One request's session on both services. Tracks what each side has seen, so a round sends
    only the new tokens, and re-opens a side with the full context if it lost the session."""

    # A verifier restarting gets 50 + 100 + ... + 800 ms; the drafter one quick retry, since the
    # request can go on without it (coordinator/decoding.py DrafterStandby).
    VERIFY_RETRIES, DRAFT_RETRIES, RETRY_BACKOFF_S = 5, 1, 0.05

    def __init__(
        self, pair: ServicePair, session_id: str, sampling: common_pb2.SamplingParams, context: list[int], steering: bool = False,
        features: bool = False, deadline: float | None = None,
    ):
        self.pair = pair
        self.deadline = deadline  # time.monotonic() by which the request must be answered; None = none
        self.session_id = session_id
        self.sampling = sampling
        self.context = list(context)
        self.prompt_length = len(context)
        self.steering = steering
        self.steering_vector: common_pb2.Tensor | None = None  # the verifier's latest, for the next draft
        # Feature head: the verifier's features of positions [0, count), float16 rows, and how
        # many of them the drafter holds.
        self.features = features
        self._feature_rows = bytearray()
        self._feature_count = self._drafter_features = 0
        self._drafter_seen: int | None = None  # context length the drafter has; None = not open
        self._drafter_round = 0
        self._verifier_round = 0
        self._verifier_open = False
        self._closed = False

    def draft(
        self, num_tokens: int, shape: TreeShape, assumed: list[int] = (), context_length: int | None = None,
        pick_excludes: list[int] = (),
    ) -> tuple[drafter_pb2.DraftResponse, ServiceCall]:
        """A draft after the committed context, or (overlapped drafting) after its first
        `context_length` tokens plus `assumed` ones and the drafter's pick of the next (not one
        of `pick_excludes`), while a verify call is in flight."""
        context = self.context[:context_length]
        steering = self.steering_vector  # the first round, before any vector exists, is unsteered
        feature_count = self._feature_count  # a verify call in flight may add more meanwhile
        sent_features = sent_round = 0

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
            )
            if steering is not None:
                message.steering.CopyFrom(steering)
            if reopen:
                message.start.CopyFrom(common_pb2.SessionStart(context_token_ids=context, sampling=self.sampling))
                message.verifier_tokenizer_fingerprint = self.pair.verifier_info.tokenizer_fingerprint
            else:
                message.new_token_ids.extend(context[self._drafter_seen :])
            if self.features:
                nonlocal sent_features
                first = 0 if reopen else self._drafter_features
                if feature_count > first:
                    width = self.pair.verifier_info.feature_size
                    message.features_start = first
                    message.features.CopyFrom(
                        common_pb2.Tensor(shape=[feature_count - first, width], dtype="float16", data=bytes(self._feature_rows[first * width * 2 : feature_count * width * 2]))
                    )
                sent_features = len(message.features.data)
            return message

        reply, call = self._call(self.pair.drafter, "Draft", drafter_pb2.DraftResponse, request, self._drafter_seen is None, self.DRAFT_RETRIES)
        self._drafter_seen, self._drafter_round = len(context), sent_round
        self._drafter_features = max(self._drafter_features, feature_count)
        call.steering_ms, call.steering_bytes = reply.steering_ms, len(steering.data) if steering is not None else 0
        call.feature_bytes, call.forward_passes = sent_features, reply.forward_passes
        return reply, call

    @property
    def can_draft(self) -> bool:
        """A feature head drafts only once the verifier has read the prompt and sent its features."""
        return not self.features or self._feature_count > 0

    def verify(self, tree: common_pb2.DraftTree | None, fused_tokens: int = 0) -> tuple[verifier_pb2.VerifyResponse, ServiceCall]:
        def request(reopen: bool) -> verifier_pb2.VerifyRequest:
            if reopen:
                self._verifier_round = 0
            message = verifier_pb2.VerifyRequest(
                session_id=self.session_id, round=self._verifier_round + 1, fused_tokens=fused_tokens, steering=self.steering,
                features=self.features,
            )
            if tree is not None:
                message.tree.CopyFrom(tree)
            if reopen:
                message.start.CopyFrom(common_pb2.SessionStart(context_token_ids=self.context, sampling=self.sampling, prompt_length=self.prompt_length))
            return message

        reply, call = self._call(self.pair.verifier, "Verify", verifier_pb2.VerifyResponse, request, not self._verifier_open, self.VERIFY_RETRIES)
        self._verifier_open = True
        self._verifier_round += 1
        self.context.extend(reply.token_ids)
        if reply.HasField("steering"):
            self.steering_vector = reply.steering
            call.steering_ms, call.steering_bytes = reply.steering_ms, len(reply.steering.data)
        if reply.HasField("features"):
            self._add_features(reply.features_start, reply.features)
            call.feature_bytes = len(reply.features.data)
        return reply, call

    def _add_features(self, start: int, tensor: common_pb2.Tensor) -> None:
        """Keeps the verifier's feature rows by position. A re-opened verifier sends them again
        from where it restarted; the drafter is then sent them again too."""
        row_bytes = self.pair.verifier_info.feature_size * 2
        if tensor.dtype != "float16" or start > self._feature_count or len(tensor.data) != tensor.shape[0] * row_bytes:
            raise RuntimeError(f"the verifier sent malformed features (start {start}, shape {list(tensor.shape)}, {tensor.dtype})")
        del self._feature_rows[start * row_bytes :]
        self._feature_rows += tensor.data
        self._feature_count = start + tensor.shape[0]
        self._drafter_features = min(self._drafter_features, start)

    def close(self) -> None:
        """Frees the session on both sides without waiting for the answers; no call opens it
        again afterwards. Called from the request's end and from its RPC's end (a cancelled
        stream), whichever comes first."""
        if self._closed:
            return
        self._closed = True
        for client in (self.pair.drafter, self.pair.verifier):
            self._end(client)

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

    def _call(self, client: MeasuredClient, method: str, response_type, build, reopen: bool, max_retries: int):
        """The call, re-opening the session once if the service lost it, and retrying a service
        that is unreachable or slow after 50, 100, 200, ... ms (at most `max_retries` times,
        within the request's deadline): the same round again, which no service commits twice."""
        request, backoff_s, retries = build(reopen), self.RETRY_BACKOFF_S, 0
        while True:
            if self._closed:
                raise ServiceError(grpc.StatusCode.CANCELLED, "the request ended")
            try:
                reply, cost = client.call(method, request, response_type, timeout=self._timeout())
                if self._closed:  # closed meanwhile: this call may have (re)opened the session after EndSession
                    self._end(client)
                return reply, ServiceCall(reply.compute_ms, cost, opened=reopen)
            except grpc.RpcError as err:
                if err.code() in _REOPEN and not reopen:
                    request, reopen = build(True), True
                    continue
                transient = err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                out_of_time = self.deadline is not None and time.monotonic() + backoff_s > self.deadline
                if not transient or retries == max_retries or out_of_time:
                    raise
                self.pair.reresolve(client)
                time.sleep(backoff_s)
                backoff_s, retries = backoff_s * 2, retries + 1


def _ended(future) -> None:
    with _ending_lock:
        _ending.discard(future)
