"""The verifier's gRPC server."""
from __future__ import annotations

import time

import grpc

from specdec.core.batching import Batcher
from specdec.core.batching import ComputeThread
from specdec.core.grammar import constraint_from_proto
from specdec.core.models import set_torch_threads
from specdec.serving.config import LimitsConfig
from specdec.serving.rpc import InProcessClient, invalid, reports_errors, start_model_server
from specdec.serving.sessions import dropped_on_failure
from specdec.serving.wire import (
    VERIFIER_SERVICE,
    model_info,
    sampling_from_proto,
    tree_from_proto,
)
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_service.verifier import Verifier


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: Verifier, compute: ComputeThread):
        self.engine = engine
        self.batcher = Batcher(compute, engine.forward_many)  # the rounds of sessions that arrive together share passes

    @reports_errors
    def Info(self, request, context):
        return model_info(self.engine, self.engine.sessions, self.engine.spec.source, self.batcher)

    @reports_errors
    def Verify(self, request: verifier_pb2.VerifyRequest, context):
        start = time.perf_counter()
        if not request.session_id:
            raise invalid("session_id is empty")
        self.engine.check_sizes(len(request.tree.token_ids), len(request.tree.parent), request.fused_tokens)
        if request.HasField("start"):
            sampling = sampling_from_proto(request.start.sampling, "start.sampling: ")
            session = self.batcher.call(
                request.session_id, self.engine.open_session, request.session_id, list(request.start.context_token_ids), sampling,
                request.start.prompt_length, request.start.keep_verifier_state, constraint_from_proto(request.start.constraint),
            )
        else:
            session = self.engine.sessions.get(request.session_id)
        tree = tree_from_proto(request.tree)
        with dropped_on_failure(self.engine.sessions, request.session_id):
            job = self.engine.verify_job(
                session, request.round, tree, request.fused_tokens, request.steering, request.verifier_state, request.forced_drafts
            )
            result = self.batcher.run(job, request.session_id)
        self.engine.sessions.fit(request.session_id)  # the grown cache may push others out
        return verifier_pb2.VerifyResponse(
            token_ids=result.token_ids,
            num_accepted_draft_tokens=result.num_accepted,
            committed_length=result.committed_length,
            compute_ms=result.compute_ms,
            handler_ms=(time.perf_counter() - start) * 1e3,
            steering=common_pb2.Tensor(**result.steering) if result.steering else None,
            steering_ms=result.steering_ms,
            verifier_state=common_pb2.VerifierState(**result.verifier_state) if result.verifier_state else None,
            verifier_state_ms=result.verifier_state_ms,
            batch_rows=result.batch_rows,
            batch_sessions=result.batch_sessions,
            grammar_ms=result.grammar_ms,
            forced_drafted=result.forced_drafted,
            forced_accepted=result.forced_accepted,
        )

    @reports_errors
    def EndSession(self, request, context):
        if not request.session_id:
            raise invalid("session_id is empty")
        return common_pb2.EndSessionResponse(existed=self.engine.sessions.pop(request.session_id) is not None)



def _servicer(config, steering_checkpoint: str | None, feature_checkpoint: str | None, limits: LimitsConfig) -> VerifierServicer:
    compute = ComputeThread()
    compute.run(set_torch_threads, config.torch_threads)
    engine = compute.run(
        Verifier, config.model, steering_checkpoint, feature_checkpoint, limits, config.prefix_cache_mib,
    )
    return VerifierServicer(engine, compute)


def in_process(
    config, steering_checkpoint: str | None = None, feature_checkpoint: str | None = None, limits: LimitsConfig = LimitsConfig(),
) -> InProcessClient:
    """The verifier inside the caller's process (the coordinator's, so a round crosses the
    network once, to the drafter)."""
    return InProcessClient(_servicer(config, steering_checkpoint, feature_checkpoint, limits), config.model.source)


def start(
    config, steering_checkpoint: str | None = None, feature_checkpoint: str | None = None, limits: LimitsConfig = LimitsConfig(),
    service_token: str = "", tls=None,
) -> tuple[grpc.Server, int]:
    """Loads the model (and its half of a steering or feature head checkpoint) and starts
    serving it; returns (grpc server, bound port). With `service_token`, callers must show it;
    with `tls` (ServiceTlsConfig), it speaks TLS only."""
    servicer = _servicer(config, steering_checkpoint, feature_checkpoint, limits)
    return start_model_server(
        lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s), VERIFIER_SERVICE, config.host, config.port, limits,
        service_token, tls,
    )
