"""Bringing a local Ray up (specdec/app/launch.py): the environment its processes start in."""
from __future__ import annotations

import os

import pytest
import ray

from specdec.app.launch import QUIET_RAY, start_local_ray


def test_a_local_ray_starts_quiet_unless_the_environment_says_otherwise(monkeypatch):
    """Ray's processes read their intervals from the environment of the process that starts
    them: every QUIET_RAY setting is there when ray.init runs, and one the user set keeps its value."""
    seen = {}

    def init(**kwargs):
        seen.update({name: os.environ.get(name) for name in QUIET_RAY})
        raise RuntimeError("not started: the test looks at the environment only")

    for name in QUIET_RAY:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(RuntimeError, match="not started"):
        start_local_ray()
    assert seen == QUIET_RAY | {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}
