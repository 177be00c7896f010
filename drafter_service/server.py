"""The drafter's gRPC server."""
from __future__ import annotations

import time

import grpc

from drafter_service.drafting_sessions import DraftingSessions
from drafter_service.drafting import VerifierState
from drafter_service.selection import drafter_for
from specdec.core.batching import Batcher
from specdec.core.batching import ComputeThread
from specdec.core.grammar import constraint_from_proto
from specdec.core.models import set_torch_threads
from specdec.core.steering import SteeringError, vector_from_tensor
from specdec.serving.config import LimitsConfig
from specdec.serving.rpc import (
    InProcessClient,
    invalid,
    reports_errors,
    start_model_server,
)
from specdec.serving.sessions import dropped_on_failure
from specdec.serving.wire import (
    DRAFTER_SERVICE,
    model_info,
    sampling_from_proto,
    shape_from_proto,
    tree_to_proto,
)
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, engine: DraftingSessions, compute: ComputeThread):
        self.engine = engine
        self.batcher = Batcher(compute, engine.forward_many)

    @reports_errors
    def Info(self, request, context):
        return model_info(self.engine.info, self.engine.sessions, self.engine.source, self.batcher)

    @reports_errors
    def Draft(self, request: drafter_pb2.DraftRequest, context):
        start = time.perf_counter()
        if not request.session_id:
            raise invalid("session_id is empty")
        if request.HasField("start"):
            sampling = sampling_from_proto(request.start.sampling, "start.sampling: ")
            session = self.batcher.call(
                request.session_id, self.engine.open_session, request.session_id, list(request.start.context_token_ids), sampling,
                request.verifier_tokenizer_fingerprint, constraint_from_proto(request.start.constraint), request.start.prompt_length,
            )
        else:
            session = self.engine.sessions.get(request.session_id)
        try:
            shape = shape_from_proto(request.tree_shape)
        except ValueError as err:
            raise invalid(f"tree_shape: {err}") from None
        steering = None
        if request.HasField("steering"):
            if not self.engine.info.steering_size:
                raise invalid(
                    "a steering vector was sent, but this drafter has no steering checkpoint loaded (the config's steering_checkpoint)"
                )
            try:
                steering = vector_from_tensor(request.steering, self.engine.info.steering_size)
            except SteeringError as err:
                raise invalid(str(err)) from None
        verifier_state = None
        if request.HasField("verifier_state"):
            if not self.engine.info.verifier_state:
                raise invalid("verifier_state was sent, but this drafter reads none")
            sent = request.verifier_state
            verifier_state = VerifierState(sent.start, sent.positions, sent.records)
        with dropped_on_failure(self.engine.sessions, request.session_id):
            job = self.engine.draft_job(
                session_id=request.session_id, session=session, new_tokens=list(request.new_token_ids),
                committed_length=request.committed_length, num_tokens=request.num_draft_tokens, shape=shape,
                assumed=list(request.assumed_token_ids), steering=steering, verifier_state=verifier_state,
                pick_excludes=list(request.pick_excludes), forced=list(request.forced_token_ids), round_number=request.round,
            )
            draft = self.batcher.run(job, request.session_id)  # the drafts of sessions that arrive together share forwards
        self.engine.sessions.fit(request.session_id)  # the grown cache may push others out
        return drafter_pb2.DraftResponse(
            tree=tree_to_proto(draft.tree),
            assumed_token_ids=draft.assumed,
            compute_ms=draft.compute_ms,
            handler_ms=(time.perf_counter() - start) * 1e3,
            steering_ms=draft.steering_ms,
            forward_passes=draft.forward_passes,
            confidence=draft.confidence,
            own_tokens_drafted=draft.own_tokens_drafted,
            reencode_rollbacks=draft.reencode_rollbacks,
            mapping_ms=draft.mapping_ms,
        )

    @reports_errors
    def EndSession(self, request, context):
        if not request.session_id:
            raise invalid("session_id is empty")
        return common_pb2.EndSessionResponse(existed=self.engine.end_session(request.session_id))



def _servicer(config, steering_checkpoint: str | None, limits: LimitsConfig, verifier_tokenizer: str | None = None) -> DrafterServicer:
    compute = ComputeThread()
    compute.run(set_torch_threads, config.torch_threads)
    engine = compute.run(
        drafter_for,
        config.model, config.proposal_top_k, steering_checkpoint=steering_checkpoint, ngram=config.ngram,
        staged_lookahead=config.staged_lookahead, limits=limits, verifier_tokenizer=verifier_tokenizer,
    )
    return DrafterServicer(engine, compute)


def in_process(config, limits: LimitsConfig) -> InProcessClient:
    """The drafter inside the caller's process (the coordinator's, for a model-free drafter)."""
    return InProcessClient(_servicer(config, None, limits), config.model.source)


def start(
    config, steering_checkpoint: str | None = None, limits: LimitsConfig = LimitsConfig(), service_token: str = "", tls=None,
    verifier_tokenizer: str | None = None,
) -> tuple[grpc.Server, int]:
    """Loads the model (and its half of a steering checkpoint) and starts serving it;
    returns (grpc server, bound port). With `service_token`, callers must show it; with `tls`
    (ServiceTlsConfig), it speaks TLS only. `verifier_tokenizer`: the verifier's model source,
    for a drafter of another tokenizer (its drafts are mapped to the verifier's tokens)."""
    servicer = _servicer(config, steering_checkpoint, limits, verifier_tokenizer)
    return start_model_server(
        lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s), DRAFTER_SERVICE, config.host, config.port, limits,
        service_token, tls,
    )
