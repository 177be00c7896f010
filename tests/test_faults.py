"""Faults a request survives: the drafter lost mid-request (killed, then restarted on its port)."""
from __future__ import annotations

import time

import coordinator.server
import drafter_service.server
import verifier_service.server
from specdec.core.models import hf_greedy
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.config import config_from_dict
from tests.conftest import tiny_config


def test_a_request_outlives_its_drafter_and_speculation_returns_with_it(tiny_dirs, tiny_verifier):
    config = config_from_dict(tiny_config(tiny_dirs, num_draft_tokens=3))
    config.coordinator.port = 0
    v_server, v_port = verifier_service.server.start(config.verifier, **config.checkpoints("verifier"))
    d_server, d_port = drafter_service.server.start(config.drafter, **config.checkpoints("drafter"))
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
        d_server, _ = drafter_service.server.start(config.drafter, **config.checkpoints("drafter"))
        deadline, drafted = time.time() + 30, 0
        while not drafted and time.time() < deadline:
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
