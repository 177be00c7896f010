"""Every kind of bad input gets a clear gRPC error naming what was wrong, and the services
keep serving others."""
from __future__ import annotations

import grpc
import pytest

from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.rpc import MeasuredClient
from specdec.serving.wire import DRAFTER_SERVICE, VERIFIER_SERVICE
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def clients(tiny_stack):
    coordinator = CoordinatorClient(tiny_stack["coordinator"])
    verifier = MeasuredClient(tiny_stack["verifier"], VERIFIER_SERVICE)
    drafter = MeasuredClient(tiny_stack["drafter"], DRAFTER_SERVICE)
    yield coordinator, verifier, drafter
    for c in (coordinator, verifier, drafter):
        c.close()


def expect_error(call, code, *phrases):
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    for phrase in phrases:
        assert phrase in err.value.details(), err.value.details()


def still_serving(coordinator):
    assert len(coordinator.generate(generate_request("w1 w2", max_new_tokens=4)).token_ids) >= 1


@pytest.mark.parametrize(
    "fields,phrases",
    [
        ({}, ["prompt is empty"]),
        ({"prompt": ""}, ["prompt is empty"]),
        ({"prompt": "w1 " * 200}, ["prompt has", "context"]),
        ({"prompt": "w1", "max_new_tokens": 0}, ["max_new_tokens"]),
        ({"prompt": "w1", "max_new_tokens": -3}, ["max_new_tokens"]),
        ({"prompt": "w1", "max_new_tokens": 100000}, ["max_new_tokens", "2048"]),
        ({"prompt": "w1", "temperature": -0.5}, ["temperature"]),
        ({"prompt": "w1", "temperature": 1.0, "top_p": 0.0}, ["top_p"]),
        ({"prompt": "w1", "temperature": 1.0, "top_p": 1.5}, ["top_p"]),
        ({"prompt": "w1", "temperature": 1.0, "top_k": -2}, ["top_k"]),
        ({"prompt_token_ids": [1, 99999]}, ["prompt_token_ids", "vocabulary"]),
        ({"prompt_token_ids": [1, -4]}, ["prompt_token_ids", "vocabulary"]),
        ({"prompt": "w1", "prompt_token_ids": [1]}, ["only one of prompt and prompt_token_ids"]),
        ({"prompt": "w1", "stop": [""]}, ["stop"]),
        ({"prompt": "w1", "stop": ["x"] * 17}, ["17 stop strings", "at most 16"]),
        ({"prompt": "w1", "stop": ["x" * 257]}, ["longer than 256 characters"]),
        ({"prompt": "w1 " * 10**6}, ["characters, more than the verifier's context"]),
        ({"prompt": "w1", "num_draft_tokens": -1}, ["num_draft_tokens"]),
        ({"prompt": "w1", "tree": common_pb2.TreeShape(method="beam")}, ["tree: method must be one of", "rsd-s"]),
        ({"prompt": "w1", "tree": common_pb2.TreeShape(method="static", branching=[2, 0])}, ["branching"]),
        ({"prompt": "w1", "tree": common_pb2.TreeShape(method="dynamic", width=10**6)}, ["tree: width must be in [1, 64]"]),
        ({"prompt": "w1", "tree": common_pb2.TreeShape(method="static", branching=[2] * 100)}, ["tree: branching must list 1 to 64"]),
        ({"prompt": "w1", "tree": common_pb2.TreeShape(max_depth=1000)}, ["max_depth must be in [0, 64]"]),
    ],
)
def test_bad_generate_requests(clients, fields, phrases):
    coordinator = clients[0]
    expect_error(lambda: coordinator.generate(generate_request(**fields)), INVALID, *phrases)
    expect_error(lambda: list(coordinator.stream(generate_request(**fields))), INVALID, *phrases)
    still_serving(coordinator)


def _verify(verifier, **fields):
    return verifier.call("Verify", verifier_pb2.VerifyRequest(**fields), verifier_pb2.VerifyResponse)


def _start(context=(1, 4, 5), **sampling):
    return common_pb2.SessionStart(context_token_ids=list(context), sampling=common_pb2.SamplingParams(**sampling))


def _tree(tokens, parents, proposals=()):
    tree = common_pb2.DraftTree(token_ids=tokens, parent=parents)
    for node, ids, probs in proposals:
        tree.expanded_nodes.append(node)
        tree.proposal.add(token_ids=ids, probs=probs)
    return tree


@pytest.mark.parametrize(
    "tree,phrases",
    [
        (_tree([3, 99], [-1, 0]), ["tree.token_ids[1] = 99", "vocabulary"]),
        (_tree([3, -1], [-1, 0]), ["tree.token_ids[1]", "vocabulary"]),
        (_tree([3, 4], [-1]), ["tree.parent has 1 entries", "tree.token_ids has 2"]),
        (_tree([3, 4], [-1, 1]), ["tree.parent[1] = 1"]),
        (_tree([3, 4], [-1, 5]), ["tree.parent[1] = 5"]),
        (_tree([3], [-1], [(-1, [3, 4], [0.5, 0.7])]), ["probs sum to"]),
        (_tree([3], [-1], [(-1, [3, 4], [1.5, -0.5])]), ["probs must be finite numbers in [0, 1]"]),
        (_tree([3], [-1], [(-1, [3, 4], [float("nan"), 0.5])]), ["finite"]),
        (_tree([3], [-1], [(-1, [3, 4], [1.0])]), ["1 probs", "2 token_ids"]),
        (_tree([3], [-1], [(-1, [4, 5], [0.5, 0.5])]), ["no probability in its proposal"]),
        (_tree([3], [-1], [(-1, [3, 77], [0.5, 0.5])]), ["outside the vocabulary"]),
        (_tree([3], [-1], [(4, [3], [1.0])]), ["expanded_nodes names node 4"]),
    ],
)
def test_malformed_draft_sent_to_the_verifier(clients, tree, phrases):
    _, verifier, _ = clients
    expect_error(lambda: _verify(verifier, session_id="bad-tree", round=1, start=_start(temperature=1.0), tree=tree), INVALID, *phrases)
    reply, _ = _verify(verifier, session_id="bad-tree", round=1, start=_start(temperature=1.0), tree=_tree([3], [-1], [(-1, [3], [1.0])]))
    assert reply.committed_length >= 4


def test_oversized_verify_calls_are_refused_before_any_work(clients):
    """A tree over max_tree_nodes (256) or fused_tokens over max_fused_tokens (64) is refused
    before the session it starts is opened, so nothing is held for it."""
    coordinator, verifier, _ = clients
    huge = common_pb2.DraftTree(token_ids=[3] * 100_000, parent=[-1] * 100_000)
    expect_error(lambda: _verify(verifier, session_id="huge", round=1, start=_start(), tree=huge), INVALID, "100000 nodes", "at most 256")
    expect_error(
        lambda: _verify(verifier, session_id="huge", round=1, start=_start(), fused_tokens=10**6), INVALID, "fused_tokens is 1000000",
        "at most 64",
    )
    ended, _ = verifier.call("EndSession", common_pb2.EndSessionRequest(session_id="huge"), common_pb2.EndSessionResponse)
    assert not ended.existed
    still_serving(coordinator)


def test_a_retried_draft_round_gets_the_same_answer(clients):
    """A Draft whose answer was lost (timeout) is sent again with the same round number: the
    drafter answers it again instead of refusing new tokens it already committed."""
    _, _, drafter = clients

    def draft(round_number, **fields):
        request = drafter_pb2.DraftRequest(session_id="retried", round=round_number, num_draft_tokens=3, **fields)
        return drafter.call("Draft", request, drafter_pb2.DraftResponse)[0]

    draft(1, start=_start(), committed_length=3)
    second = draft(2, new_token_ids=[6, 7], committed_length=5)
    again = draft(2, new_token_ids=[6, 7], committed_length=5)
    assert list(again.tree.token_ids) == list(second.tree.token_ids) and len(second.tree.token_ids) == 3
    assert len(draft(3, new_token_ids=[8], committed_length=6).tree.token_ids) == 3  # and the session goes on
    expect_error(lambda: draft(4, new_token_ids=[8], committed_length=6), grpc.StatusCode.FAILED_PRECONDITION, "out of sync")


def test_mismatched_proposal_arrays(clients):
    _, verifier, _ = clients
    tree = _tree([3], [-1], [(-1, [3], [1.0])])
    tree.expanded_nodes.append(0)
    expect_error(
        lambda: _verify(verifier, session_id="s", round=1, start=_start(), tree=tree), INVALID, "expanded_nodes has 2", "proposal has 1"
    )


def test_unknown_session(clients):
    coordinator, verifier, drafter = clients
    expect_error(lambda: _verify(verifier, session_id="never-opened", round=1), grpc.StatusCode.NOT_FOUND, "unknown session 'never-opened'")
    expect_error(
        lambda: drafter.call(
            "Draft", drafter_pb2.DraftRequest(session_id="never-opened", num_draft_tokens=2, committed_length=3), drafter_pb2.DraftResponse
        ),
        grpc.StatusCode.NOT_FOUND,
        "unknown session",
    )
    expect_error(lambda: _verify(verifier, session_id="", round=1), INVALID, "session_id is empty")
    still_serving(coordinator)


def test_bad_session_starts(clients):
    _, verifier, drafter = clients
    expect_error(lambda: _verify(verifier, session_id="x", round=1, start=_start(context=())), INVALID, "start.context_token_ids is empty")
    expect_error(lambda: _verify(verifier, session_id="x", round=1, start=_start(context=(1, 500))), INVALID, "outside the vocabulary")
    expect_error(
        lambda: _verify(verifier, session_id="x", round=1, start=_start(temperature=-1.0)), INVALID, "start.sampling", "temperature"
    )
    expect_error(
        lambda: drafter.call(
            "Draft",
            drafter_pb2.DraftRequest(session_id="y", start=_start(), committed_length=3, num_draft_tokens=0),
            drafter_pb2.DraftResponse,
        ),
        INVALID,
        "num_draft_tokens",
    )


def test_mismatched_tokenizer_is_refused(clients):
    _, _, drafter = clients
    request = drafter_pb2.DraftRequest(
        session_id="tok", start=_start(), committed_length=3, num_draft_tokens=2, verifier_tokenizer_fingerprint="0" * 32
    )
    expect_error(lambda: drafter.call("Draft", request, drafter_pb2.DraftResponse), INVALID, "mismatched tokenizers")


def test_coordinator_refuses_a_mismatched_pair(tiny_dirs):
    from coordinator.clients import PairMismatch
    from specdec.serving.config import config_from_dict
    from tests.conftest import plain_services, service_pair

    config = config_from_dict(
        {"verifier": {"model": str(tiny_dirs["verifier"])}, "drafter": {"model": str(tiny_dirs["other_words"])}}
    )
    with plain_services(config) as addresses, pytest.raises(PairMismatch, match="mismatched tokenizers"):
        service_pair(*addresses)


def test_bad_tree_shape_sent_to_the_drafter(clients):
    drafter = clients[2]
    request = drafter_pb2.DraftRequest(
        session_id="shape", start=_start(), committed_length=3, num_draft_tokens=4, tree_shape=common_pb2.TreeShape(method="bushy")
    )
    expect_error(lambda: drafter.call("Draft", request, drafter_pb2.DraftResponse), INVALID, "tree_shape", "bushy")
    # A huge width would rank width^2 candidates per depth under the model lock: refused before
    # any (10^12 of them would outlast the call's 30 s deadline by far).
    request.tree_shape.CopyFrom(common_pb2.TreeShape(method="dynamic", width=10**6))
    expect_error(lambda: drafter.call("Draft", request, drafter_pb2.DraftResponse, timeout=30), INVALID, "tree_shape", "width")
    still_serving(clients[0])


def test_assumed_tokens_outside_the_vocabulary(clients):
    drafter = clients[2]
    request = drafter_pb2.DraftRequest(
        session_id="assumed", start=_start(), committed_length=3, num_draft_tokens=2, assumed_token_ids=[4, 99999]
    )
    expect_error(lambda: drafter.call("Draft", request, drafter_pb2.DraftResponse), INVALID, "assumed_token_ids", "vocabulary")
    still_serving(clients[0])


class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code, details):
        raise _Aborted(code, details)


class _DownstreamError(grpc.RpcError, grpc.Call):
    """What a failed call to another service raises."""

    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def initial_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False


def test_failures_reach_the_caller_without_internals(caplog):
    """An unexpected exception, or another service refusing a call this one made, is this
    side's fault: INTERNAL with a request id, details only in the log. A downstream status
    about the request itself (unavailable, deadline, load, context length) is passed on."""
    from specdec.core.errors import RequestError, StaleSession
    from specdec.serving.rpc import reports_errors

    class Servicer:
        @reports_errors
        def Call(self, request, context):
            raise request

    def answer(err):
        with pytest.raises(_Aborted) as aborted:
            Servicer().Call(err, _Context())
        return aborted.value.args

    code, details = answer(KeyError("/secret/path/model.bin"))
    assert code == grpc.StatusCode.INTERNAL and "request id" in details and "secret" not in details
    request_id = details.split("request id ")[1].split(")")[0]
    assert request_id in caplog.text and "secret" in caplog.text
    code, details = answer(_DownstreamError(INVALID, "tree.parent[3] = 9 must be -1"))
    assert code == grpc.StatusCode.INTERNAL and "tree.parent" not in details
    assert answer(_DownstreamError(grpc.StatusCode.UNAVAILABLE, "verifier restarting")) == (
        grpc.StatusCode.UNAVAILABLE, "verifier restarting"
    )
    # The model-side code's own errors (specdec/core/errors.py) get their status here, at the server.
    assert answer(RequestError("tree.ngram none asks for a model")) == (INVALID, "tree.ngram none asks for a model")
    assert answer(StaleSession("verifier_state.start 9 leaves a gap")) == (
        grpc.StatusCode.FAILED_PRECONDITION, "verifier_state.start 9 leaves a gap"
    )


def test_bearer_tokens_guard_the_client_api_but_not_health(tiny_dirs, tmp_path):
    """With coordinator.auth, Generate needs 'authorization: Bearer <token>' (from the config
    or a file); without it, or with another token, UNAUTHENTICATED. Health stays open."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.serving.config import ConfigError, config_from_dict
    from specdec.serving.wire import COORDINATOR_SERVICE
    from tests.conftest import local_stack, tiny_config

    (tmp_path / "tokens").write_text("# one per line\nfile-token\n")
    config = tiny_config(tiny_dirs, auth={"tokens": ["config-token"], "tokens_file": str(tmp_path / "tokens")})
    with local_stack(config) as stack:
        request = generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=4)
        for token in (None, "wrong", "config-toke"):
            client = CoordinatorClient(stack["coordinator"], token)
            expect_error(lambda: client.generate(request), grpc.StatusCode.UNAUTHENTICATED, "bearer token")
            expect_error(lambda: list(client.stream(request)), grpc.StatusCode.UNAUTHENTICATED, "bearer token")
            health = health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            client.close()
        for token in ("config-token", "file-token"):
            client = CoordinatorClient(stack["coordinator"], token)
            assert len(client.generate(request).token_ids) == 4
            client.close()
    with pytest.raises(ConfigError, match="cannot read"):
        config_from_dict(tiny_config(tiny_dirs, auth={"tokens_file": str(tmp_path / "absent")}))


def test_the_limits_section_bounds_every_service(tiny_dirs):
    """Lowered limits reach all three services: each refuses past them, naming the bound."""
    from tests.conftest import local_stack, tiny_config

    limits = {"max_draft_tokens": 5, "max_tree_nodes": 6, "max_fused_tokens": 8, "max_new_tokens": 50, "max_stop_strings": 1}
    adaptive = {"chain_budgets": [1, 2, 4], "tree_budgets": [5]}
    config = tiny_config(tiny_dirs, fused_block_tokens=4, default_max_new_tokens=20, adaptive=adaptive) | {"limits": limits}
    with local_stack(config) as stack:
        coordinator = CoordinatorClient(stack["coordinator"])
        verifier = MeasuredClient(stack["verifier"], VERIFIER_SERVICE)
        drafter = MeasuredClient(stack["drafter"], DRAFTER_SERVICE)
        try:
            for fields, phrase in (
                ({"num_draft_tokens": 6}, "[0, 5]"),
                ({"tree": common_pb2.TreeShape(method="dynamic", width=6)}, "width must be in [1, 5]"),
                ({"max_new_tokens": 51}, "[1, 50]"),
                ({"stop": ["a", "b"]}, "at most 1"),
            ):
                expect_error(lambda: coordinator.generate(generate_request("w1", **fields)), INVALID, phrase)
            draft = drafter_pb2.DraftRequest(session_id="d", start=_start(), committed_length=3, num_draft_tokens=6)
            expect_error(lambda: drafter.call("Draft", draft, drafter_pb2.DraftResponse), INVALID, "[1, 5]")
            tree = common_pb2.DraftTree(token_ids=[4] * 7, parent=[-1] + list(range(6)))
            expect_error(lambda: _verify(verifier, session_id="v", round=1, start=_start(), tree=tree), INVALID, "at most 6")
            expect_error(lambda: _verify(verifier, session_id="f", round=1, start=_start(), fused_tokens=9), INVALID, "at most 8")
            assert len(coordinator.generate(generate_request("w1 w2", max_new_tokens=50, num_draft_tokens=5)).token_ids) >= 1
        finally:
            for client in (coordinator, verifier, drafter):
                client.close()


def test_an_oversized_request_message_is_refused_by_size(clients):
    """limits.max_request_mib (4) bounds what a client may send, before anything is parsed."""
    coordinator = clients[0]
    expect_error(lambda: coordinator.generate(generate_request("w1 " * 2_000_000)), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
    still_serving(coordinator)


def test_a_flooded_service_refuses_calls_instead_of_queueing_them(tiny_dirs, monkeypatch):
    """A service takes at most SERVICE_CALLS_PER_REQUEST x limits.max_concurrent_requests calls
    at once: with that many held in the verifier, one more gets RESOURCE_EXHAUSTED, not a place
    in a queue (where it would wait out its deadline); let go, the held ones are answered and
    it goes on serving."""
    import verifier_service.server
    from specdec.serving.config import config_from_dict
    from specdec.serving.rpc import SERVICE_CALLS_PER_REQUEST
    from tests.conftest import VerifyGate, tiny_config

    config = config_from_dict(tiny_config(tiny_dirs) | {"limits": {"max_concurrent_requests": 1}})
    limit = SERVICE_CALLS_PER_REQUEST * config.limits.max_concurrent_requests
    gate = VerifyGate(monkeypatch, lambda request: True)
    # A verifier of its own: no coordinator's calls take a slot meanwhile.
    v_server, v_port = verifier_service.server.start(config.verifier, **config.service_args("verifier"))
    verifier = MeasuredClient(f"localhost:{v_port}", VERIFIER_SERVICE)
    try:
        with gate:
            held = [
                verifier.call_async(
                    "Verify", verifier_pb2.VerifyRequest(session_id=f"f{i}", round=1, start=_start(), fused_tokens=2), timeout=60
                )
                for i in range(limit)
            ]
            assert gate.wait_held(limit)
            one_more = verifier_pb2.VerifyRequest(session_id="one-more", round=1, start=_start(), fused_tokens=2)
            expect_error(
                lambda: verifier.call("Verify", one_more, verifier_pb2.VerifyResponse, timeout=60), grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            gate.open()
            assert [f.exception() for f in held] == [None] * limit
        assert _verify(verifier, session_id="after", round=1, start=_start(), fused_tokens=2)[0].token_ids
    finally:
        verifier.close()
        v_server.stop(grace=None)
