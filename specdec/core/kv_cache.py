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
    so a forward writes its new tokens in place instead of concatenating the whole cache.
    Values are [layers, kv_heads, capacity, head_dim]; keys the same, or with `transposed_keys`
    the layouts the native attention kernel reads: [layers, kv_heads, head_dim, capacity], and
    in bfloat16 pairs of channels, [layers, kv_heads, head_dim / 2, capacity, 2]."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 256,
                 transposed_keys: bool = False):
        self.values = torch.empty(num_layers, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        if not transposed_keys:
            self.keys = torch.empty_like(self.values)
        elif dtype == torch.bfloat16:
            self.keys = torch.empty(num_layers, num_kv_heads, head_dim // 2, capacity, 2, dtype=dtype, device=device)
        else:
            self.keys = torch.empty(num_layers, num_kv_heads, head_dim, capacity, dtype=dtype, device=device)
        self.transposed_keys = transposed_keys
        self.length = 0
        self._by_layer = None

    def get_seq_length(self) -> int:
        return self.length

    def _positions(self, tensor: torch.Tensor) -> int:
        return self.key_positions if tensor is self.keys else 2

    @property
    def key_positions(self) -> int:
        """The dimension of `keys` that runs over positions."""
        return 3 if self.transposed_keys else 2

    @property
    def by_layer(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Each layer's keys and values, as views made once per allocation: a native pass reads
        them for every layer and session, and indexing them each time made 2 x layers tensors
        per session and pass (2% of a 32-session pass)."""
        if self._by_layer is None:
            self._by_layer = (self.keys.unbind(0), self.values.unbind(0))
        return self._by_layer

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of positions [start, end)."""
        return self.keys.narrow(self.key_positions, start, end - start).clone(), self.values.narrow(2, start, end - start).clone()

    def write_rows(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Sets positions [start, start + n) (reserved) to `keys` and `values` (as `rows` gives
        them) and drops any after them."""
        count = values.shape[2]
        self.keys.narrow(self.key_positions, start, count).copy_(keys)
        self.values.narrow(2, start, count).copy_(values)
        self.length = start + count

    def reserve(self, length: int) -> None:
        capacity = self.values.shape[2]
        if length > capacity:
            while capacity < length:
                capacity *= 2
            for name in ("keys", "values"):
                old = getattr(self, name)
                dim = self._positions(old)
                shape = list(old.shape)
                shape[dim] = capacity
                bigger = old.new_empty(shape)
                bigger.narrow(dim, 0, self.length).copy_(old.narrow(dim, 0, self.length))
                setattr(self, name, bigger)
            self._by_layer = None

    def keep_positions(self, prefix_len: int, extra: list[int]) -> None:
        """Keep positions [0, prefix_len) plus `extra` (ascending, all >= prefix_len)."""
        if extra:
            index = torch.tensor(extra, device=self.values.device)
            for tensor in (self.keys, self.values):
                dim = self._positions(tensor)
                tensor.narrow(dim, prefix_len, len(extra)).copy_(tensor.index_select(dim, index))
        self.length = prefix_len + len(extra)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // self.values.shape[2]


def cache_nbytes(cache: KVCache | TransformersCache | None) -> int:
    """Memory a session's cache holds (a model-free drafter keeps none)."""
    if cache is None:
        return 0
    if isinstance(cache, KVCache):
        return cache.nbytes
    # Read while another session's forward may be filling its layers: a missing tensor counts 0.
    tensors = [getattr(layer, name, None) for layer in cache.layers for name in ("keys", "values")]
    return sum(t.nbytes for t in tensors if t is not None)
