"""Benchmarks: `specdec bench` and its studies (RTT sweep, steering ablation)."""
