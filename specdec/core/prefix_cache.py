"""Prompt prefixes read before, kept for the sessions that start with them (prefix caching, as
in vLLM's automatic prefix caching): a new session copies the cached rows of its prompt's
longest cached prefix into its own cache and reads only the rest.

Blocks of `BLOCK_TOKENS` tokens, each keyed by its parent block and its own tokens, so a key
names the whole prefix exactly (no hash to collide). A block keeps its keys and values and the
residual stream at `depths` (what a feature-head verifier fuses), evicted least recently used
past `max_bytes`. Exact only on an engine whose rows depend on their own sequence alone (the
native layers): a cached row is then bit for bit the row a full read of the prompt computes."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from specdec.core.kv_cache import KVCache

BLOCK_TOKENS = 16


@dataclass
class PrefixBlock:
    number: int  # the key of its children
    keys: torch.Tensor  # the cache's layout, BLOCK_TOKENS positions
    values: torch.Tensor
    states: tuple[torch.Tensor, ...]  # [BLOCK_TOKENS, hidden] at each of the cache's depths

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + sum(s.nbytes for s in self.states)


class PrefixCache:
    """Thread-safe."""

    def __init__(self, max_bytes: int, depths: tuple[int, ...] = ()):
        self.max_bytes = max_bytes
        self.depths = depths
        self._blocks: OrderedDict[tuple[int, tuple[int, ...]], PrefixBlock] = OrderedDict()
        self._bytes = 0
        self._numbers = 0
        self._lock = threading.Lock()
        self.hit_tokens = self.read_tokens = 0  # prompt tokens copied from the cache, and read by a pass

    def match(self, tokens: list[int]) -> list[PrefixBlock]:
        """The cached blocks of the longest cached prefix of `tokens`, in order."""
        found, parent = [], 0
        with self._lock:
            for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
                key = (parent, tuple(tokens[start : start + BLOCK_TOKENS]))
                block = self._blocks.get(key)
                if block is None:
                    break
                self._blocks.move_to_end(key)
                found.append(block)
                parent = block.number
        return found

    def load(self, blocks: list[PrefixBlock], cache: KVCache) -> tuple[torch.Tensor, ...]:
        """Writes the blocks' rows into an empty cache; their states, one tensor per depth."""
        length = len(blocks) * BLOCK_TOKENS
        cache.reserve(length)
        cache.write_rows(0, torch.cat([b.keys for b in blocks], dim=cache.key_positions), torch.cat([b.values for b in blocks], dim=2))
        return tuple(torch.cat(layer) for layer in zip(*(b.states for b in blocks)))

    def store(self, tokens: list[int], cache: KVCache, states: tuple[torch.Tensor, ...]) -> None:
        """Keeps the full blocks of `tokens`, whose rows `cache` holds from position 0 (and
        `states` at the cache's depths, one row per token)."""
        parent = 0
        for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            key = (parent, tuple(tokens[start : start + BLOCK_TOKENS]))
            with self._lock:
                block = self._blocks.get(key)
            if block is None:
                keys, values = cache.rows(start, start + BLOCK_TOKENS)
                block = PrefixBlock(0, keys, values, tuple(s[start : start + BLOCK_TOKENS].clone() for s in states))
                if block.nbytes > self.max_bytes:
                    return
                with self._lock:
                    self._numbers += 1
                    block.number = self._numbers
                    self._blocks[key] = block
                    self._bytes += block.nbytes
                    while self._bytes > self.max_bytes:
                        _, evicted = self._blocks.popitem(last=False)  # its children become unreachable and age out
                        self._bytes -= evicted.nbytes
            parent = block.number

    def count(self, hit: int, read: int) -> None:
        """A prompt whose first `hit` tokens came from the cache and `read` more from a pass."""
        with self._lock:
            self.hit_tokens += hit
            self.read_tokens += read
