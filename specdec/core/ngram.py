"""Drafting without a model: the tokens that followed earlier occurrences of the context's
last few tokens, in the request's own context (prompt lookup; Saxena 2023, transformers'
`prompt_lookup_num_tokens`, vLLM's `ngram`) and, for suffix decoding (Oliaro et al. 2024),
also in the recent outputs of all requests, merged into a tree scored by how often each
continuation occurred.

Drafts are deterministic (point-mass proposals), so verification stays exact for greedy
decoding and for sampling alike."""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

from specdec.core.tree import NGRAM_METHODS, ROOT, DraftTree


def is_model_free(source: str) -> bool:
    """A drafter model source that names an n-gram method drafts with no model at all."""
    return source in NGRAM_METHODS


@dataclass
class NgramSettings:
    """How the n-gram drafter matches and drafts (the YAML section drafter.ngram)."""

    method: str = ""  # with a model drafter: "" (model only) or an NGRAM_METHODS entry (hybrid)
    max_ngram: int = 4  # longest suffix of the context matched
    min_ngram: int = 2  # shortest; below it there is no match and no draft
    max_occurrences: int = 64  # suffix: most recent occurrences whose continuations form the tree
    min_share: float = 0.1  # suffix: drop nodes fewer than this share of the occurrences went through
    length_factor: float = 3.0  # suffix: draft depth at most this many times the matched length
    recent_output_tokens: int = 65536  # suffix: tokens of finished outputs kept for all requests (0 = none)

    def validate(self, model_free: bool) -> None:
        """Raises ValueError naming the bad key."""
        if self.method and self.method not in NGRAM_METHODS:
            raise ValueError(f"method must be '' or one of {', '.join(NGRAM_METHODS)}, got '{self.method}'")
        checks = [
            (1 <= self.min_ngram <= self.max_ngram <= 32, "min_ngram and max_ngram must satisfy 1 <= min_ngram <= max_ngram <= 32"),
            (self.max_occurrences >= 1, "max_occurrences must be >= 1"),
            (0.0 <= self.min_share <= 1.0, "min_share must be in [0, 1]"),
            (self.length_factor > 0, "length_factor must be > 0"),
            (self.recent_output_tokens >= 0, "recent_output_tokens must be >= 0"),
            (not (model_free and self.method), "method is for a model drafter (hybrid); a model-free drafter is chosen by drafter.model"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class NgramIndex:
    """Every n-gram (n <= max_n) of a growing token list, by the positions where it ends."""

    def __init__(self, max_n: int, tokens: list[int] = ()):
        self.max_n = max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1
            for n in range(1, min(self.max_n, end + 1) + 1):
                self._ends.setdefault(tuple(self.tokens[end - n + 1 : end + 1]), []).append(end)

    def continued(self, pattern: tuple[int, ...]) -> list[int]:
        """End positions of `pattern` that some token follows, latest first."""
        last = len(self.tokens) - 1
        return [end for end in reversed(self._ends.get(pattern, ())) if end < last]

    def continuation(self, end: int, depth: int) -> list[int]:
        return self.tokens[end + 1 : end + 1 + depth]


class RecentOutputs:
    """The outputs of finished requests, for suffix decoding across requests; the oldest go
    first once they hold more than `max_tokens`."""

    def __init__(self, max_tokens: int, max_n: int):
        self.max_tokens = max_tokens
        self.max_n = max_n
        self._indexes: deque[NgramIndex] = deque()
        self._size = 0
        self._lock = threading.Lock()

    def add(self, tokens: list[int]) -> None:
        tokens = list(tokens)[-self.max_tokens :] if self.max_tokens else []
        if len(tokens) < 2:
            return
        index = NgramIndex(self.max_n, tokens)
        with self._lock:
            self._indexes.append(index)
            self._size += len(tokens)
            while self._size > self.max_tokens:
                self._size -= len(self._indexes.popleft().tokens)

    def snapshot(self) -> list[NgramIndex]:
        with self._lock:
            return list(self._indexes)

    def __len__(self) -> int:
        return self._size


class NgramProposer:
    """One of NGRAM_METHODS with its settings; sessions hold their own NgramIndex."""

    def __init__(self, method: str, settings: NgramSettings):
        if method not in NGRAM_METHODS:
            raise ValueError(f"unknown n-gram method '{method}'; known: {', '.join(NGRAM_METHODS)}")
        self.method = method
        self.settings = settings
        self.recent = RecentOutputs(settings.recent_output_tokens if method == "suffix" else 0, settings.max_ngram)

    def new_index(self, context: list[int]) -> NgramIndex:
        return NgramIndex(self.settings.max_ngram, context)

    def finished(self, output: list[int]) -> None:
        """A request's output, remembered for the requests after it (suffix)."""
        if self.recent.max_tokens:
            self.recent.add(output)

    def propose(self, index: NgramIndex, tail: list[int], budget: int, max_depth: int = 0) -> DraftTree:
        """A tree of at most `budget` nodes to follow `tail` (the context's last tokens; `index`
        holds the committed ones), or an empty tree when nothing matches."""
        settings = self.settings
        sources = [index] + (self.recent.snapshot() if self.method == "suffix" else [])
        for n in range(min(settings.max_ngram, len(tail)), settings.min_ngram - 1, -1):
            pattern = tuple(tail[-n:])
            matches = [(source, end) for source in sources for end in source.continued(pattern)]
            if matches:
                break
        else:
            return DraftTree()
        depth = min(budget, max_depth or budget)
        if self.method == "prompt-lookup":
            source, end = matches[0]  # the latest occurrence in the context
            return continuation_tree([source.continuation(end, depth)], budget, 0.0)
        depth = min(depth, math.ceil(settings.length_factor * n))
        continuations = [source.continuation(end, depth) for source, end in matches[: settings.max_occurrences]]
        return continuation_tree(continuations, budget, settings.min_share)


class OwnChoices:
    """A back-off model of a drafter built from its own drafts, the second stage of staged
    speculation: what it chose last after each pair of tokens, else after the last token."""

    def __init__(self):
        self._after: dict[tuple[int, ...], int] = {}

    def record(self, before: list[int], token: int) -> None:
        self._after[tuple(before[-2:])] = token
        self._after[tuple(before[-1:])] = token

    def guess(self, tail: list[int], length: int) -> list[int]:
        """Up to `length` tokens the drafter would likely draft after `tail`."""
        tail, guessed = list(tail[-2:]), []
        while len(guessed) < length:
            token = self._after.get(tuple(tail[-2:]), self._after.get(tuple(tail[-1:])))
            if token is None:
                break
            guessed.append(token)
            tail.append(token)
        return guessed


def continuation_tree(continuations: list[list[int]], budget: int, min_share: float) -> DraftTree:
    """The trie of `continuations`, cut to the `budget` nodes that the most of them pass
    through (at least `min_share` of them). A node's share is the empirical probability of its
    path given the match, and never exceeds its parent's, so the kept nodes form a tree."""
    trie, counts, child = DraftTree(), [], {}
    for tokens in continuations:
        node = ROOT
        for token in tokens:
            if (node, token) not in child:
                child[node, token] = trie.add(token, node)
                counts.append(0)
            node = child[node, token]
            counts[node] += 1
    least = min_share * len(continuations)
    # Ties keep the earlier node: a parent before its children, the latest occurrence first.
    kept = sorted((n for n in range(len(trie)) if counts[n] >= least), key=lambda n: (-counts[n], n))[:budget]
    return trie.subtree(sorted(kept))


def merge_trees(first: DraftTree, second: DraftTree, budget: int) -> DraftTree:
    """`first`, then the paths of `second` that `first` lacks, up to `budget` nodes. Both must
    be deterministic (no proposals): a deterministic child cannot join children sampled from
    a proposal."""
    assert not first.proposals and not second.proposals, "only deterministic trees merge"
    merged = DraftTree(list(first.token_ids[:budget]), list(first.parent[:budget]))
    child = {(p, t): n for n, (p, t) in enumerate(zip(merged.parent, merged.token_ids))}
    where = {ROOT: ROOT}
    for node, (parent, token) in enumerate(zip(second.parent, second.token_ids)):
        if parent not in where:  # its parent did not fit
            continue
        key = (where[parent], token)
        if key not in child:
            if len(merged) >= budget:
                continue
            child[key] = merged.add(token, where[parent])
        where[node] = child[key]
    return merged
