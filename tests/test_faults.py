"""Faults a request survives: the drafter lost mid-request (killed, then restarted on its port)."""
from __future__ import annotations

import time

import grpc
import pytest

import coordinator.server
import drafter_service.server
import verifier_service.server
from specdec.core.models import hf_greedy
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.config import config_from_dict
from specdec.serving.wire import VERIFIER_SERVICE
from tests.conftest import VerifyGate, service_info, tiny_config


def test_a_request_outlives_its_drafter_and_speculation_returns_with_it(tiny_dirs, tiny_verifier):
    config = config_from_dict(tiny_config(tiny_dirs, num_draft_tokens=3))
    config.coordinator.port = 0
    v_server, v_port = verifier_service.server.start(config.verifier, **config.service_args("verifier"))
    d_server, d_port = drafter_service.server.start(config.drafter, **config.service_args("drafter"))
    c_server, c_port, coord = coordinator.server.start(config, f"localhost:{d_port}", f"localhost:{v_port}")
    client = CoordinatorClient(f"localhost:{c_port}")
    try:
        prompt = [1, 4, 5]
        stream = client.stream(generate_request(prompt_token_ids=prompt, max_new_tokens=60))
        tokens = list(next(stream).token_ids)
        d_server.stop(grace=None).wait()  # the drafter goes away mid-request
        last = None
        for last in stream:
            tokens += list(last.token_ids)
        assert tokens == hf_greedy(tiny_verifier, prompt, 60)  # finished exactly, by the verifier alone
        assert last.stats.drafter_failures >= 1 and last.finish_reason

        config.drafter.port = d_port  # back on the same port: speculation resumes
        d_server, _ = drafter_service.server.start(config.drafter, **config.service_args("drafter"))
        deadline, drafted = time.monotonic() + 60, 0  # a hang guard: it ends as soon as a request drafts
        while not drafted and time.monotonic() < deadline:
            reply = client.generate(generate_request(prompt_token_ids=[1, 9], max_new_tokens=40))
            assert list(reply.token_ids) == hf_greedy(tiny_verifier, [1, 9], 40)
            drafted = reply.stats.drafted_tokens
            time.sleep(0.2)
        assert drafted > 0
    finally:
        client.close()
        for server in (c_server, d_server, v_server):
            server.stop(grace=None)
        coord.pair.close()


def _sessions_held(addresses: list[str]) -> list[int]:
    from specdec.serving.rpc import MeasuredClient
    from specdec.serving.wire import DRAFTER_SERVICE, VERIFIER_SERVICE
    from specdec.v1 import common_pb2

    held = []
    for address, service in zip(addresses, (DRAFTER_SERVICE, VERIFIER_SERVICE)):
        client = MeasuredClient(address, service)
        held.append(client.call("Info", common_pb2.InfoRequest(), common_pb2.ModelInfo)[0].active_sessions)
        client.close()
    return held


def _until(condition, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_deadlines_and_cancellation_stop_the_rounds_and_free_both_sides(tiny_dirs):
    """Behind 40 ms links a 400-token request (121 tokens: what the tiny context leaves room
    for) takes many seconds. A client deadline of 0.8 s ends it (every internal call gets only
    what is left), a cancelled stream stops its rounds, and either way neither service holds a
    session of it afterwards, freed before the rounds could have run to the end: the verifier
    ran fewer passes than the 121 tokens need at 4 a round at most."""
    import grpc

    from tests.conftest import local_stack

    link = {"rtt_ms": 40}
    config = tiny_config(tiny_dirs, num_draft_tokens=3, network={"drafter": link, "verifier": link})
    with local_stack(config) as stack:
        services = [stack["drafter"], stack["verifier"]]
        client = CoordinatorClient(stack["coordinator"])
        request = generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=400)

        def passes() -> int:
            return service_info(stack["verifier"], VERIFIER_SERVICE).forward_passes

        try:
            client.stub.Generate(request, timeout=0.8)
            raise AssertionError("the request should not finish within its deadline")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _until(lambda: _sessions_held(services) == [0, 0], 60), _sessions_held(services)  # 60 s: a hang guard
        assert passes() < 121 / 4

        before = passes()
        stream = client.stub.GenerateStream(request)
        next(stream), next(stream)
        assert _sessions_held(services) == [1, 1]
        stream.cancel()
        assert _until(lambda: _sessions_held(services) == [0, 0], 60), _sessions_held(services)
        assert passes() - before < 121 / 4
        client.close()


def test_a_stopping_server_says_not_serving_and_finishes_its_streams(tiny_dirs, tiny_verifier):
    """Graceful shutdown: health turns NOT_SERVING at once, a new request is refused, and a
    stream already in flight runs to its end within the grace period."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.serving.rpc import stop_gracefully
    from specdec.serving.wire import COORDINATOR_SERVICE

    link = {"rtt_ms": 20}
    config = config_from_dict(tiny_config(tiny_dirs, num_draft_tokens=3, network={"drafter": link, "verifier": link}))
    config.coordinator.port = 0
    v_server, v_port = verifier_service.server.start(config.verifier)
    d_server, d_port = drafter_service.server.start(config.drafter)
    c_server, c_port, coord = coordinator.server.start(config, f"localhost:{d_port}", f"localhost:{v_port}")
    client = CoordinatorClient(f"localhost:{c_port}")
    health = health_pb2_grpc.HealthStub(client.channel)
    try:
        prompt = [1, 4, 5]
        stream = client.stream(generate_request(prompt_token_ids=prompt, max_new_tokens=60))
        tokens = list(next(stream).token_ids)
        stopped = stop_gracefully(c_server, drain_s=0.5, grace_s=20)
        status = health.Check(health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE)).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        last = None
        for last in stream:
            tokens += list(last.token_ids)
        assert last.finish_reason and tokens == hf_greedy(tiny_verifier, prompt, 60)
        assert stopped.wait(60)  # a hang guard: the drain is 0.5 s
        try:
            client.generate(generate_request(prompt_token_ids=prompt, max_new_tokens=4), timeout=5)
            raise AssertionError("a stopped server answered")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        client.close()
        for server in (c_server, d_server, v_server):
            server.stop(grace=None)
        coord.pair.close()


def test_a_forward_that_fails_part_way_drops_its_session(tiny_dirs, monkeypatch):
    """The verifier's forward fails after writing part of its cache: the call answers
    INTERNAL and the verifier forgets the session, so a retry finds no half-extended cache but
    NOT_FOUND, which makes the coordinator re-open the session with the full context."""
    import grpc

    from specdec.serving.rpc import MeasuredClient
    from specdec.serving.wire import VERIFIER_SERVICE
    from specdec.v1 import common_pb2, verifier_pb2
    from tests.conftest import local_stack
    from verifier_service.verifier import Verifier

    real, failing = Verifier._forward, {"now": False}

    def flaky(self, session, input_ids, *args, **kwargs):
        if failing["now"]:
            failing["now"] = False
            real(self, session, input_ids[:1], 1, False)  # part of the work done, then the failure
            raise RuntimeError("simulated failure inside a forward")
        return real(self, session, input_ids, *args, **kwargs)

    monkeypatch.setattr(Verifier, "_forward", flaky)
    with local_stack(tiny_config(tiny_dirs)) as stack:
        verifier = MeasuredClient(stack["verifier"], VERIFIER_SERVICE)

        def verify(round_number, **fields):
            request = verifier_pb2.VerifyRequest(session_id="flaky", round=round_number, fused_tokens=2, **fields)
            return verifier.call("Verify", request, verifier_pb2.VerifyResponse)[0]

        verify(1, start=common_pb2.SessionStart(context_token_ids=[1, 4, 5], sampling=common_pb2.SamplingParams()))
        failing["now"] = True
        for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.NOT_FOUND):
            with pytest.raises(grpc.RpcError) as err:
                verify(2)
            assert err.value.code() == code, err.value.details()
        verifier.close()


def _later_rounds_of_the_first_session():
    """For VerifyGate: the calls after the first of the first session the verifier sees (that
    request's first answer comes back; then it waits in the verifier until the gate opens)."""
    first = []

    def hold(request) -> bool:
        if not first:
            first.append(request.session_id)
        return request.session_id == first[0] and request.round > 1

    return hold


def test_overload_is_refused_at_once_not_queued(tiny_dirs, monkeypatch):
    """With limits.max_concurrent_requests = 1, a second request while one is in flight (held
    in the verifier after its first round) gets RESOURCE_EXHAUSTED, not a place in a queue,
    where it would wait out its deadline; once the first ends, requests are served again."""
    import grpc

    from tests.conftest import local_stack

    config = tiny_config(tiny_dirs, num_draft_tokens=3) | {"limits": {"max_concurrent_requests": 1}}
    gate = VerifyGate(monkeypatch, _later_rounds_of_the_first_session())
    with local_stack(config) as stack, gate:
        client = CoordinatorClient(stack["coordinator"])
        stream = client.stream(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=40))
        next(stream)
        with pytest.raises(grpc.RpcError) as err:
            client.generate(generate_request(prompt_token_ids=[1, 9], max_new_tokens=4), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        gate.open()
        assert list(stream)[-1].finish_reason
        assert len(client.generate(generate_request(prompt_token_ids=[1, 9], max_new_tokens=4)).token_ids) == 4
        client.close()


def test_a_cancelled_stream_frees_its_slot_at_once(tiny_dirs, monkeypatch):
    """A client that cancels a stream finds its slot free once the coordinator has heard of the
    cancel, though the cancelled request's round is still going: held in the verifier, it
    ends only after the next request was served. (Asked before the cancel arrives, the next
    request is refused: it asks again until served.)"""
    from tests.conftest import local_stack

    config = tiny_config(tiny_dirs, num_draft_tokens=3) | {"limits": {"max_concurrent_requests": 1}}
    gate = VerifyGate(monkeypatch, _later_rounds_of_the_first_session())
    with local_stack(config) as stack, gate:
        client = CoordinatorClient(stack["coordinator"])
        stream = client.stream(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=40))
        next(stream)
        assert gate.wait_held(1)  # its second round is in the verifier
        stream.cancel()
        served = []

        def next_request_served() -> bool:
            try:
                served.append(client.generate(generate_request(prompt_token_ids=[1, 9], max_new_tokens=2)))
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
            return bool(served)

        # Served while the gate is still shut: the cancelled request's verify call still waits.
        assert _until(next_request_served, 60)  # 60 s: a hang guard
        assert len(served[0].token_ids) == 2
        client.close()


def test_a_finished_stream_frees_its_slot_before_its_last_message(tiny_dirs, monkeypatch):
    """At the limit, a client that has read a stream's last message (the one with finish_reason)
    may ask again at once, without waiting for the stream's end, even where the server's thread
    runs on late after sending it."""
    from coordinator.server import Coordinator
    from tests.conftest import local_stack

    answer = Coordinator.generate

    def late_after_the_last(self, *args, **kwargs):
        yield from answer(self, *args, **kwargs)
        time.sleep(0.5)

    monkeypatch.setattr(Coordinator, "generate", late_after_the_last)
    config = tiny_config(tiny_dirs, num_draft_tokens=3) | {"limits": {"max_concurrent_requests": 1}}
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        for _ in range(5):
            stream = client.stream(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=6))
            assert next(part for part in stream if part.finish_reason)
            assert client.generate(generate_request(prompt_token_ids=[1, 9], max_new_tokens=2)).finish_reason
        client.close()


def test_a_restarting_verifier_is_waited_for_and_the_session_reopened(tiny_dirs, tiny_verifier, monkeypatch):
    """The verifier goes away mid-stream and is back on its port 0.3 s later, without the
    session: the coordinator retries with back-off, re-opens with the full context (re-prefill),
    and the output is exactly the verifier's own."""
    import threading

    from coordinator.clients import PairSession

    # The service's 5 retries (1.55 s of back-off) cover a quick restart; on a busy machine the
    # restart and gRPC's reconnect back-off (1 s, then 1.6 times more) may take longer. The
    # test is about being waited for, not how fast this machine restarts a server: 51 s.
    monkeypatch.setattr(PairSession, "VERIFY_RETRIES", 10)
    config = config_from_dict(tiny_config(tiny_dirs, num_draft_tokens=3))
    config.coordinator.port = 0
    v_server, v_port = verifier_service.server.start(config.verifier)
    d_server, d_port = drafter_service.server.start(config.drafter)
    c_server, c_port, coord = coordinator.server.start(config, f"localhost:{d_port}", f"localhost:{v_port}")
    client = CoordinatorClient(f"localhost:{c_port}")
    servers = {"verifier": v_server}

    def restart():
        time.sleep(0.3)
        config.verifier.port = v_port
        servers["verifier"], _ = verifier_service.server.start(config.verifier)

    try:
        prompt = [1, 4, 5]
        stream = client.stream(generate_request(prompt_token_ids=prompt, max_new_tokens=60))
        tokens = list(next(stream).token_ids)
        v_server.stop(grace=None).wait()
        threading.Thread(target=restart).start()
        last = None
        for last in stream:
            tokens += list(last.token_ids)
        assert last.finish_reason and tokens == hf_greedy(tiny_verifier, prompt, 60)
        assert last.stats.session_reopens >= 1  # the restarted verifier had lost the session
    finally:
        client.close()
        for server in (c_server, d_server, servers["verifier"]):
            server.stop(grace=None)
        coord.pair.close()


def test_health_says_whether_the_verifier_can_be_reached(tiny_dirs):
    """The coordinator's health follows the verifier: NOT_SERVING while it is gone, when a
    request fails UNAVAILABLE within seconds with a message that says so (and names no internal
    address), SERVING once it is back."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.serving.rpc import wait_until_serving

    config = config_from_dict(tiny_config(tiny_dirs))
    config.coordinator.port = 0
    v_server, v_port = verifier_service.server.start(config.verifier)
    d_server, d_port = drafter_service.server.start(config.drafter)
    c_server, c_port, coord = coordinator.server.start(config, f"localhost:{d_port}", f"localhost:{v_port}")
    servers = [c_server, d_server, v_server]
    address = f"localhost:{c_port}"

    def status() -> int:
        with grpc.insecure_channel(address) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="specdec.v1.Coordinator"), timeout=5
            ).status

    try:
        assert status() == health_pb2.HealthCheckResponse.SERVING
        v_server.stop(grace=None).wait()
        deadline = time.monotonic() + 60  # a hang guard: it goes on as soon as health says it
        while status() != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health still says SERVING with the verifier gone"
            time.sleep(0.5)
        client = CoordinatorClient(address)
        asked = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=4), timeout=30)
        client.close()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - asked < 10
        assert "no verifier replica answers" in refused.value.details() and "localhost" not in refused.value.details()
        config.verifier.port = v_port
        servers[2], _ = verifier_service.server.start(config.verifier)
        wait_until_serving(address, 60, "specdec.v1.Coordinator")
    finally:
        for server in servers:
            server.stop(grace=None)
        coord.pair.close()


def test_kv_memory_is_bounded_per_session_and_in_total(tiny_dirs, tiny_verifier):
    """One session may not grow its KV cache past limits.max_session_kv_mib (RESOURCE_EXHAUSTED
    before any forward); past limits.max_kv_mib in total the least recently used session is
    evicted, and its request re-opens it and stays exact."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from specdec.core.engine import engine_for
    from specdec.core.models import ModelSpec, load_model
    from specdec.serving.sessions import SessionStore
    from tests.conftest import local_stack

    # The served (float32) verifier's cache per token; it runs as transformers does, its cache
    # growing by the token. Each request's session reaches ~25 tokens: the total holds one, not three.
    per_token = engine_for(load_model(ModelSpec(str(tiny_dirs["verifier"]))), "float32").kv_bytes_per_token
    limits = {"max_session_kv_mib": 40 * per_token / 2**20, "max_kv_mib": 40 * per_token / 2**20}
    config = tiny_config(tiny_dirs, num_draft_tokens=2) | {"limits": limits}
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(generate_request(prompt_token_ids=[3] * 45, max_new_tokens=4))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.max_session_kv_mib" in refused.value.details()
        prompts = [[1, 4, 5], [2, 6, 7], [3, 8, 9]]
        with ThreadPoolExecutor(max_workers=3) as pool:
            replies = list(pool.map(lambda p: client.generate(generate_request(prompt_token_ids=p, max_new_tokens=20)), prompts))
        assert [list(reply.token_ids) for reply in replies] == [hf_greedy(tiny_verifier, p, 20) for p in prompts]
        # The bound evicted sessions mid-request, and their requests re-opened them.
        assert service_info(stack["verifier"], VERIFIER_SERVICE).evicted_sessions >= 1
        assert sum(reply.stats.session_reopens for reply in replies) >= 1
        client.close()

    store = SessionStore(8, 60.0, max_bytes=10, size_of=len)
    for name, size in (("a", "xxxx"), ("b", "xxxx"), ("c", "xxxxxx")):
        store.put(name, size)
        store.fit(name)
    assert store.pop("a") is None and store.pop("b") == "xxxx" and store.pop("c") == "xxxxxx"  # 14 > 10: the oldest went
    assert store.evicted == 1  # ending sessions (pop) is no eviction


def test_services_take_calls_only_with_the_service_token(tiny_dirs, tiny_verifier):
    from specdec.serving.rpc import MeasuredClient
    from specdec.serving.wire import VERIFIER_SERVICE
    from specdec.v1 import common_pb2
    from tests.conftest import local_stack

    config = tiny_config(tiny_dirs)
    config["coordinator"]["auth"] = {"service_token": "between-us"}
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        assert list(client.generate(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=8)).token_ids) == hf_greedy(
            tiny_verifier, [1, 4, 5], 8
        )
        client.close()
        for token, allowed in (("", False), ("guess", False), ("between-us", True)):
            verifier = MeasuredClient(stack["verifier"], VERIFIER_SERVICE, token)
            end = common_pb2.EndSessionRequest(session_id="x")
            if allowed:
                assert not verifier.call("EndSession", end, common_pb2.EndSessionResponse)[0].existed
            else:
                with pytest.raises(grpc.RpcError) as refused:
                    verifier.call("EndSession", end, common_pb2.EndSessionResponse)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Health and Info (what runs here, its load) stay open for probes and monitoring.
            assert verifier.reachable() and verifier.call("Info", common_pb2.InfoRequest(), common_pb2.ModelInfo)[0].vocab_size > 0
            verifier.close()


def test_tls_on_the_client_api(tiny_dirs, tmp_path):
    """With coordinator.tls the client API speaks TLS only: a client that trusts the
    certificate is served, a plaintext one is not."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    config = tiny_config(tiny_dirs)
    config["coordinator"]["tls"] = {"cert_file": str(tmp_path / "cert.pem"), "key_file": str(tmp_path / "key.pem")}
    from tests.conftest import local_stack

    with local_stack(config) as stack:
        trusted = CoordinatorClient(stack["coordinator"], root_certificates=(tmp_path / "cert.pem").read_bytes())
        assert len(trusted.generate(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=4)).token_ids) == 4
        trusted.close()
        plain = CoordinatorClient(stack["coordinator"])
        with pytest.raises(grpc.RpcError) as refused:
            plain.generate(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=4), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        plain.close()


@pytest.mark.parametrize("mutual", [True, False], ids=["mutual", "server-only"])
def test_tls_on_the_links_to_the_services(tiny_dirs, tiny_verifier, tmp_path, mutual):
    """coordinator.service_tls: the services speak TLS only, the coordinator checks their
    certificate (and, mutual, shows its own); the output stays exact. A plaintext caller, or
    (mutual) one without a certificate the CA signed, is refused."""
    import grpc

    from specdec.core.models import hf_greedy
    from specdec.serving.config import ServiceTlsConfig
    from specdec.serving.rpc import MeasuredClient
    from specdec.serving.wire import VERIFIER_SERVICE
    from specdec.v1 import common_pb2
    from tests.certs import make_certificates, service_tls
    from tests.conftest import local_stack

    paths = make_certificates(tmp_path)
    config = tiny_config(tiny_dirs)
    config["coordinator"]["service_tls"] = service_tls(paths, mutual)
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        reply = client.generate(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=12, num_draft_tokens=3))
        client.close()
        assert list(reply.token_ids) == hf_greedy(tiny_verifier, [1, 4, 5], 12) and reply.stats.speculative_rounds > 0

        def info(tls) -> None:
            caller = MeasuredClient(stack["verifier"], VERIFIER_SERVICE, tls=tls)
            try:
                caller.call("Info", common_pb2.InfoRequest(), common_pb2.ModelInfo, timeout=10)
            finally:
                caller.close()

        info(ServiceTlsConfig(**service_tls(paths, mutual)))  # the coordinator's own credentials pass
        with pytest.raises(grpc.RpcError) as plaintext:
            info(None)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
        if mutual:
            with pytest.raises(grpc.RpcError) as anonymous:
                info(ServiceTlsConfig(**service_tls(paths, mutual=False)))
            assert anonymous.value.code() == grpc.StatusCode.UNAVAILABLE
