"""The three services as separate plain gRPC server processes (no Ray), as on Kubernetes
without Ray: `python -m verifier_service`, `python -m drafter_service`, `python -m coordinator`."""
from __future__ import annotations

import subprocess
import sys

from specdec.core.models import hf_greedy
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.rpc import wait_until_serving
from tests.conftest import free_port


PROMPT = [1, 4, 5, 6]


def test_services_as_separate_processes(tiny_dirs, tiny_verifier, tmp_path):
    """A speculative request through the three processes gives the verifier alone's greedy
    tokens (through the same servers, and transformers' `generate()`), and it did speculate."""
    v_port, d_port, c_port = free_port(), free_port(), free_port()
    config = tmp_path / "config.yaml"
    config.write_text(f"verifier:\n  model: {tiny_dirs['verifier']}\n  torch_threads: 1\n")
    commands = [
        [sys.executable, "-m", "verifier_service", "--config", str(config), "--port", str(v_port)],
        [sys.executable, "-m", "drafter_service", "--model", str(tiny_dirs["drafter"]), "--port", str(d_port)],
    ]
    processes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in commands]
    try:
        wait_until_serving(f"localhost:{v_port}", 120, "specdec.v1.Verifier")
        wait_until_serving(f"localhost:{d_port}", 120, "specdec.v1.Drafter")
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "coordinator", "--config", str(config), "--port", str(c_port),
                 "--drafter", f"localhost:{d_port}", "--verifier", f"localhost:{v_port}"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
        )
        wait_until_serving(f"localhost:{c_port}", 120, "specdec.v1.Coordinator")
        client = CoordinatorClient(f"localhost:{c_port}")
        reply = client.generate(generate_request(prompt_token_ids=PROMPT, max_new_tokens=12, num_draft_tokens=3))
        alone = client.generate(generate_request(prompt_token_ids=PROMPT, max_new_tokens=12, num_draft_tokens=0))
        client.close()
        assert list(reply.token_ids) == list(alone.token_ids) == hf_greedy(tiny_verifier, PROMPT, 12)
        assert reply.stats.speculative_rounds >= 1 and reply.stats.drafted_tokens > 0 and alone.stats.speculative_rounds == 0
        assert reply.stats.bytes_sent > 0 and reply.stats.draft_compute_ms > 0
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            output, _ = process.communicate(timeout=30)
            assert process.returncode in (0, -15), output
