"""`specdec bench --cost-curve ... --roofline`: what the machine allows a forward of k new tokens.
A pass streams the model's linear weights once (bytes / memory bandwidth) and multiplies k rows
through them (k x multiply-adds / the format's peak rate), so no pass of k tokens is faster than
max(bytes / bandwidth, k x MACs / peak). Both rates are measured here: the bandwidth by reading a
buffer larger than the caches with both threads, each format's peak by multiplying 64 rows
through one of its own layers (its weights then stay in cache: arithmetic bound), with the
kernel path this CPU takes for it. Both are read after every round of the curve (RoundRates):
these machines' bandwidth swings ~2x within minutes, so each pass is set against its own
round's roof."""
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


def linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers a pass streams: every quantized linear (its packed weights) or float Linear,
    the head included; the embedding only reads a row a token and is left out."""
    return [m for m in model.modules() if hasattr(m, "packed") or type(m) is torch.nn.Linear]


def streamed_bytes(model: torch.nn.Module) -> int:
    return sum(m.packed.nbytes if hasattr(m, "packed") else m.weight.nbytes for m in linears(model))


def macs_per_token(model: torch.nn.Module) -> int:
    return sum(m.in_features * m.out_features for m in linears(model))


def _widest_decoder_linear(model: torch.nn.Module) -> torch.nn.Module:
    """The peak's layer: the head's format may differ from the decoder's, so it is left out."""
    return max((m for m in linears(model) if m.out_features < 100_000), key=lambda m: m.in_features * m.out_features)


class RoundRates:
    """The machine's rates, read once after each round of a curve: the memory bandwidth (a read
    of a buffer past the caches with the process's threads) and, for each model, the multiply-adds
    per second of 64 rows through its widest decoder linear."""

    def __init__(self, models: dict[str, torch.nn.Module], repeats: int = 3):
        self.models, self.repeats = models, repeats
        self._buffer = torch.ones(_STREAM_BYTES, dtype=torch.int8)
        self._layers = {name: _widest_decoder_linear(model) for name, model in models.items()}
        self._sizes = {name: {"bytes": streamed_bytes(model), "macs_per_token": macs_per_token(model)} for name, model in models.items()}
        self.bandwidths: list[float] = []
        self.peaks: dict[str, list[float]] = {name: [] for name in models}

    def read(self) -> None:
        self.bandwidths.append(_STREAM_BYTES / _median_seconds(self._buffer.max, self.repeats))
        for name, layer in self._layers.items():
            x = torch.randn(_PEAK_ROWS, layer.in_features)
            self.peaks[name].append(_PEAK_ROWS * layer.in_features * layer.out_features / _median_seconds(lambda: layer(x), self.repeats))

    def roof(self, name: str) -> dict:
        """A model's bytes and multiply-adds a token, with the median of the rates read."""
        return self._sizes[name] | {
            "peak_macs_per_s": statistics.median(self.peaks[name]), "bandwidth_bytes_per_s": statistics.median(self.bandwidths),
            "peak_macs_per_s_by_round": self.peaks[name], "bandwidth_bytes_per_s_by_round": self.bandwidths}

    def roof_ms_by_round(self, name: str, tokens: int) -> list[float]:
        return [roof_ms(self._sizes[name] | {"bandwidth_bytes_per_s": bandwidth, "peak_macs_per_s": peak}, tokens)
                for bandwidth, peak in zip(self.bandwidths, self.peaks[name])]


def roof_ms(roof: dict, tokens: int) -> float:
    """The fastest a pass of `tokens` new tokens can be: max(memory time, arithmetic time)."""
    return 1e3 * max(roof["bytes"] / roof["bandwidth_bytes_per_s"], tokens * roof["macs_per_token"] / roof["peak_macs_per_s"])
