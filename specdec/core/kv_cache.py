"""Session KV caches, each keeping exactly the committed tokens after a verification pass:
transformers' dynamic cache with the two edits sessions need, and the engine's preallocated
cache with the same edits."""
from __future__ import annotations

import torch
from transformers import DynamicCache


class TransformersCache(DynamicCache):
    def keep_positions(self, prefix_len: int, extra: list[int]) -> None:
        """Keep cache positions [0, prefix_len) plus `extra` (ascending, all >= prefix_len) and
        drop the rest, in place. Contiguous keeps are a crop; tree paths are gathered."""
        if extra == list(range(prefix_len, prefix_len + len(extra))):
            self.truncate(prefix_len + len(extra))
            return
        keep = torch.cat([torch.arange(prefix_len), torch.tensor(extra, dtype=torch.long)])
        for layer in self.layers:
            keep_dev = keep.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, keep_dev)
            layer.values = layer.values.index_select(-2, keep_dev)

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions, in place."""
        for layer in self.layers:
            if layer.keys is not None and layer.keys.shape[-2] > length:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]


class KVCache:
    """Keys and values of the tokens a session has fed, preallocated and grown by doubling,
    so a forward writes its new tokens in place instead of concatenating the whole cache."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 256):
        self.keys = torch.empty(num_layers, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, length: int) -> None:
        capacity = self.keys.shape[2]
        if length > capacity:
            while capacity < length:
                capacity *= 2
            for name in ("keys", "values"):
                bigger = self.keys.new_empty(*self.keys.shape[:2], capacity, self.keys.shape[3])
                bigger[:, :, : self.length] = getattr(self, name)[:, :, : self.length]
                setattr(self, name, bigger)

    def keep_positions(self, prefix_len: int, extra: list[int]) -> None:
        """Keep positions [0, prefix_len) plus `extra` (ascending, all >= prefix_len)."""
        if extra:
            index = torch.tensor(extra, device=self.keys.device)
            end = prefix_len + len(extra)
            self.keys[:, :, prefix_len:end] = self.keys[:, :, index]
            self.values[:, :, prefix_len:end] = self.values[:, :, index]
        self.length = prefix_len + len(extra)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)
