"""What a forward pass of an engine costs: the one timer of `specdec bench --cost-curve` and of
`dtype: auto` (specdec/core/models.py), measured interleaved (every repetition visits every
engine and k in turn, so a drift in machine speed hits all alike)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

WARMUP_ROUNDS = 2  # the first repetitions, untimed: they warm caches and allocators


def pass_times(
    engines: dict[str, tuple[object, list[int]]], context_ids: list[int], repeats: int,
    rounds: Callable[[range], Iterable[int]] = lambda r: r,
) -> dict[tuple[str, int], list[float]]:
    """(name, k) -> the ms of each repetition's pass of k new tokens after `context_ids`, for
    each engine (name -> (engine, the k to time)). `rounds` wraps the repetitions (a progress bar; a generator may work between them)."""
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        caches = {}
        for name, (engine, _) in engines.items():
            caches[name] = engine.new_cache()
            engine(caches[name], context_ids, prefill=True)
        for repeat in rounds(range(repeats + WARMUP_ROUNDS)):
            for name, (engine, tokens) in engines.items():
                # one untimed pass first: every timed pass then follows a pass of its own engine, as
                # a served verifier's do (a large last-level cache still holds part of its weights),
                # not another engine's, whose weights would have pushed them out
                for k, timed in [(tokens[0], False)] + [(k, True) for k in tokens]:
                    cache = caches[name]
                    cache.truncate(len(context_ids))
                    new = context_ids[-k:] if k <= len(context_ids) else (context_ids * k)[:k]
                    start = time.perf_counter()
                    logits, _ = engine(cache, new, num_logits=k)
                    logits.cpu()  # a GPU runs asynchronously: the time ends when the logits exist
                    if timed and repeat >= WARMUP_ROUNDS:
                        times.setdefault((name, k), []).append((time.perf_counter() - start) * 1e3)
    return times
