"""Ray Serve autoscaling for the model services, driven by the sessions their replicas hold.

Serve's default policy counts the requests that pass through its handles, and the per-round data
plane bypasses them (direct gRPC), so it would see an idle deployment under any load. Each model
replica reports its sessions instead (ModelReplica.record_autoscaling_stats), and this policy asks
for as many replicas as those sessions need. Serve applies min/max replicas and the up- and
down-scale delays around it. In deploy/serve.yaml:

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      policy:
        policy_function: specdec.serving.autoscaling:SessionsPolicy
        policy_kwargs: {target_sessions: 16}
"""
from __future__ import annotations

import math


class SessionsPolicy:
    def __init__(self, target_sessions: float = 16.0):
        if target_sessions <= 0:
            raise ValueError(f"target_sessions must be positive, got {target_sessions}")
        self.target_sessions = target_sessions

    def __call__(self, ctx) -> tuple[int, dict]:
        sessions = sum((ctx.aggregated_metrics or {}).get("sessions", {}).values())
        return replicas_for(sessions, self.target_sessions), {"sessions": sessions}


def replicas_for(sessions: float, target_sessions: float) -> int:
    """Replicas that hold `sessions` at about `target_sessions` each (at least one: a replica
    starting a model takes tens of seconds, too long to wait for on a first request)."""
    return max(1, math.ceil(sessions / target_sessions))
