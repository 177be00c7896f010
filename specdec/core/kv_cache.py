"""Keeping a KV cache to exactly the committed tokens after a verification pass."""
from __future__ import annotations

import torch
from transformers import DynamicCache


def keep_positions(cache: DynamicCache, prefix_len: int, extra: list[int]) -> None:
    """Keep cache positions [0, prefix_len) plus `extra` (ascending, all >= prefix_len) and
    drop the rest, in place. Contiguous keeps are a crop; tree paths are gathered."""
    if extra == list(range(prefix_len, prefix_len + len(extra))):
        truncate(cache, prefix_len + len(extra))
        return
    keep = torch.cat([torch.arange(prefix_len), torch.tensor(extra, dtype=torch.long)])
    for layer in cache.layers:
        keep_dev = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, keep_dev)
        layer.values = layer.values.index_select(-2, keep_dev)


def truncate(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions, in place."""
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]
