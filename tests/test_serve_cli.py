"""`specdec serve --demo` as a person runs it (./run.sh runs the same on the coder pair): the
stack starts, the demo streams its answer and prints what speculation bought, and Ctrl-C,
sent to the whole process group as a terminal sends it, stops everything without an error line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_the_demo_prints_the_speedup_line_and_ctrl_c_stops_cleanly():
    specdec = Path(sys.executable).with_name("specdec")
    command = [
        str(specdec), "serve", "--config", "deploy/smollm2.yaml", "--demo",
        "--port", str(free_port()), "--http-port", str(free_port()), "--grpc-proxy-port", str(free_port()),
    ]
    # Python's fault handler on: a stop that hangs is ended with SIGABRT, which prints every thread's stack.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    server = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines = []
    try:
        for line in server.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C to stop."):
                break
        ready = len(lines)
        os.killpg(server.pid, signal.SIGINT)
        started = time.monotonic()
        try:
            rest, _ = server.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            server.send_signal(signal.SIGABRT)
            rest, _ = server.communicate(timeout=30)
            pytest.fail("the stop hung for 120 s; the stacks at SIGABRT:\n" + "".join(lines[-20:]) + rest)
        lines += rest.splitlines(keepends=True)
        assert server.returncode == 0, "".join(lines)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    output = "".join(lines)
    assert "playground on http://localhost:" in output
    speedup = [line for line in lines if line.startswith("speculation ")]
    assert len(speedup) == 1 and "tok/s, the verifier alone" in speedup[0] and speedup[0].rstrip().endswith("the same text"), output
    after = "".join(lines[ready:])
    assert after.split() == ["stopping..."] or all(
        word not in after for word in ("Traceback", "Error", "error", "failed", "(raylet)")
    ), after
    assert time.monotonic() - started < 60
    assert not _group_alive(server.pid, wait_s=15), "Ray processes outlived the stop"


def _group_alive(group: int, wait_s: float) -> bool:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.5)
    return True
