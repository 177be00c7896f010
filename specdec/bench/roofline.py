"""`specdec bench --cost-curve ... --roofline`: what the machine allows a forward of k new tokens.
A pass streams the model's linear weights once (bytes / memory bandwidth) and multiplies k rows
through them (k x multiply-adds / the format's peak rate), so no pass of k tokens is faster than
max(bytes / bandwidth, k x MACs / peak). Both rates are measured here: the bandwidth by reading a
buffer larger than the caches with both threads, each format's peak by multiplying 64 rows
through one of its own layers (its weights then stay in cache: arithmetic bound), with the
kernel path this CPU takes for it."""
from __future__ import annotations

import statistics
import time

import torch

_STREAM_BYTES = 1 << 30  # past any last-level cache these machines have
_PEAK_ROWS = 64


def _median_seconds(run, repeats: int) -> float:
    """run()'s median time over `repeats` calls, after one that warms caches and allocators."""
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def memory_bandwidth(repeats: int = 5) -> float:
    """Bytes per second read from memory with the process's threads (median of `repeats`)."""
    buffer = torch.ones(_STREAM_BYTES, dtype=torch.int8)
    return _STREAM_BYTES / _median_seconds(buffer.max, repeats)


def linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers a pass streams: every quantized linear (its packed weights) or float Linear,
    the head included; the embedding only reads a row a token and is left out."""
    return [m for m in model.modules() if hasattr(m, "packed") or type(m) is torch.nn.Linear]


def streamed_bytes(model: torch.nn.Module) -> int:
    return sum(m.packed.nbytes if hasattr(m, "packed") else m.weight.nbytes for m in linears(model))


def macs_per_token(model: torch.nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in linears(model))


def peak_macs(model: torch.nn.Module, repeats: int = 5) -> float:
    """Multiply-adds per second of the model's widest decoder linear (the head's format may
    differ) on 64 rows, median of `repeats`."""
    layer = max((m for m in linears(model) if m.out_features < 100_000), key=lambda m: m.in_features * m.out_features)
    x = torch.randn(_PEAK_ROWS, layer.in_features)
    return _PEAK_ROWS * layer.in_features * layer.out_features / _median_seconds(lambda: layer(x), repeats)


def roofline(model: torch.nn.Module, bandwidth: float) -> dict:
    """The model's bytes and multiply-adds a token, its format's measured peak, and `bandwidth`."""
    return {"bytes": streamed_bytes(model), "macs_per_token": macs_per_token(model), "peak_macs_per_s": peak_macs(model),
            "bandwidth_bytes_per_s": bandwidth}


def roof_ms(roof: dict, tokens: int) -> float:
    """The fastest a pass of `tokens` new tokens can be: max(memory time, arithmetic time)."""
    return 1e3 * max(roof["bytes"] / roof["bandwidth_bytes_per_s"], tokens * roof["macs_per_token"] / roof["peak_macs_per_s"])
