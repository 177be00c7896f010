"""Drafting without a model: the tokens that followed earlier occurrences of the context's
last few tokens, in the request's own context (prompt lookup; Saxena 2023, transformers'
`prompt_lookup_num_tokens`, vLLM's `ngram`) and, for suffix decoding (Oliaro et al. 2024),
also in the recent outputs of all requests, merged into a tree scored by how often each
continuation occurred.

Drafts are deterministic (point-mass proposals), so verification stays exact for greedy
decoding and for sampling alike. Each node carries a confidence, the estimated chance that the
verifier accepts the path to it, learned from how often drafts after a match of each length
were accepted; the coordinator verifies only the nodes worth their cost (coordinator/budget.py)."""
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
    # hybrid: where the context matches, the n-gram draft goes alone (no drafter forward); the
    # model drafts only where it does not (false: both share each tree's budget)
    fallback: bool = False
    max_ngram: int = 4  # longest suffix of the context matched
    min_ngram: int = 2  # shortest; below it there is no match and no draft
    max_occurrences: int = 64  # suffix: most recent occurrences whose continuations form the tree
    min_share: float = 0.1  # suffix: drop nodes fewer than this share of the occurrences went through
    length_factor: float = 3.0  # suffix: draft depth at most this many times the matched length
    # Memory across requests (0 = each request alone): suffix keeps this many tokens of finished
    # outputs, staged drafting three times as many of the drafter's own choices.
    recent_output_tokens: int = 65536

    def __post_init__(self) -> None:
        """Checked wherever settings are made: raises ValueError naming the bad key."""
        if self.method and self.method not in NGRAM_METHODS:
            raise ValueError(f"method must be '' or one of {', '.join(NGRAM_METHODS)}, got '{self.method}'")
        checks = [
            (1 <= self.min_ngram <= self.max_ngram <= 32, "min_ngram and max_ngram must satisfy 1 <= min_ngram <= max_ngram <= 32"),
            (self.max_occurrences >= 1, "max_occurrences must be >= 1"),
            (0.0 <= self.min_share <= 1.0, "min_share must be in [0, 1]"),
            (self.length_factor > 0, "length_factor must be > 0"),
            (self.recent_output_tokens >= 0, "recent_output_tokens must be >= 0"),
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

    def continued_count(self, pattern: tuple[int, ...]) -> int:
        """len(continued(pattern)), without listing them: only the last token has no follower."""
        ends = self._ends.get(pattern, ())
        return len(ends) - (bool(ends) and ends[-1] == len(self.tokens) - 1)

    def count(self, pattern: tuple[int, ...]) -> int:
        """Occurrences of `pattern` (at most max_n tokens)."""
        return len(self._ends.get(pattern, ()))

    def continuation(self, end: int, depth: int) -> list[int]:
        return self.tokens[end + 1 : end + 1 + depth]


class NgramLM:
    """An interpolated n-gram language model over an NgramIndex (Jelinek-Mercer): each order
    whose history occurred adds its relative frequency, longer histories weighing more, and a
    small floor keeps unseen tokens finite. It rescores lattice paths (blockwise parallel
    decoding refinement, Kim et al.)."""

    FLOOR = 1e-6

    def __init__(self, index: NgramIndex):
        self.index = index

    def probs(self, history: list[int], tokens: list[int]) -> list[float]:
        """P(token | history) of each of `tokens`, history's last tokens first in weight."""
        index, orders = self.index, []  # (weight, history of that order, times it was continued)
        for n in range(min(index.max_n - 1, len(history)) + 1):
            before = tuple(history[len(history) - n :])
            seen = index.continued_count(before) if n else len(index.tokens)
            if not seen:
                break
            orders.append((2.0**n, before, seen))
        weights = sum(weight for weight, _, _ in orders)
        if not weights:
            return [self.FLOOR] * len(tokens)
        return [
            sum(weight * index.count(before + (token,)) / seen for weight, before, seen in orders) / weights + self.FLOOR
            for token in tokens
        ]


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


class MatchAcceptance:
    """How often a drafted token was the verifier's, by how many tokens were matched before
    it (the context's matched suffix plus the draft tokens before it): the longer the run of
    copied tokens, the likelier the next one is copied too. Counts with a uniform prior."""

    LONGEST = 32  # matches at least this long share one count

    def __init__(self):
        self._hits = [1.0] * (self.LONGEST + 1)
        self._trials = [2.0] * (self.LONGEST + 1)
        self._lock = threading.Lock()

    def probability(self, matched: int) -> float:
        m = min(matched, self.LONGEST)
        return self._hits[m] / self._trials[m]

    def record(self, matched: int, accepted: bool) -> None:
        m = min(matched, self.LONGEST)
        with self._lock:
            self._hits[m] += accepted
            self._trials[m] += 1


@dataclass
class NgramDraft:
    tree: DraftTree
    confidence: list[float]  # per node: the estimated chance that the verifier accepts its path
    matched: int = 0  # length of the context suffix the draft continues

    def __len__(self) -> int:
        return len(self.tree)


class NgramProposer:
    """One of NGRAM_METHODS with its settings; sessions hold their own NgramIndex."""

    def __init__(self, method: str, settings: NgramSettings):
        if method not in NGRAM_METHODS:
            raise ValueError(f"unknown n-gram method '{method}'; known: {', '.join(NGRAM_METHODS)}")
        self.method = method
        self.settings = settings
        self.recent = RecentOutputs(settings.recent_output_tokens if method == "suffix" else 0, settings.max_ngram)
        self.acceptance = MatchAcceptance()

    def new_index(self, context: list[int]) -> NgramIndex:
        return NgramIndex(self.settings.max_ngram, context)

    def finished(self, output: list[int]) -> None:
        """A request's output, remembered for the requests after it (suffix)."""
        if self.recent.max_tokens:
            self.recent.add(output)

    def learn(self, draft: NgramDraft, committed: list[int]) -> None:
        """What the verifier committed right after `draft` was proposed: each depth the draft
        reached counts as accepted when some node there was the committed token."""
        node = ROOT
        for depth, token in enumerate(committed):
            children = draft.tree.children(node)
            if not children:
                return
            hit = next((c for c in children if draft.tree.token_ids[c] == token), None)
            self.acceptance.record(draft.matched + depth, hit is not None)
            if hit is None:
                return
            node = hit

    def propose(self, index: NgramIndex, tail: list[int], budget: int, max_depth: int = 0) -> NgramDraft:
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
            return NgramDraft(DraftTree(), [])
        depth = min(budget, max_depth or budget)
        if self.method == "prompt-lookup":
            source, end = matches[0]  # the latest occurrence in the context
            tree, shares = continuation_tree([source.continuation(end, depth)], budget, 0.0)
        else:
            depth = min(depth, math.ceil(settings.length_factor * n))
            continuations = [source.continuation(end, depth) for source, end in matches[: settings.max_occurrences]]
            tree, shares = continuation_tree(continuations, budget, settings.min_share)
        return NgramDraft(tree, self._confidence(tree, shares, n), n)

    def _confidence(self, tree: DraftTree, shares: list[float], matched: int) -> list[float]:
        """A node's share of the occurrences times the chance that each depth down to it is
        accepted; never above its parent's, so the most confident nodes form a tree."""
        reach, confidence = {ROOT: 1.0}, []
        for node, (parent, depth) in enumerate(zip(tree.parent, tree.depths())):
            reach[node] = reach[parent] * self.acceptance.probability(matched + depth - 1)
            confidence.append(min(reach[node] * shares[node], confidence[parent] if parent != ROOT else 1.0))
        return confidence


class OwnChoices:
    """A back-off model of a drafter built from its own drafts, the second stage of staged
    speculation: what it chose last after the same three tokens, else two, else one. A drafter
    with memory across requests shares one among its sessions (it repeats its choices across
    requests too); past `max_entries` histories the older half is dropped."""

    ORDERS = (3, 2, 1)

    def __init__(self, max_entries: int = 1 << 20):
        self.max_entries = max_entries
        self._recent: dict[tuple[int, ...], int] = {}
        self._older: dict[tuple[int, ...], int] = {}

    def record(self, before: list[int], token: int) -> None:
        if len(self._recent) >= self.max_entries // 2:
            self._older, self._recent = self._recent, {}
        for n in self.ORDERS:
            if len(before) >= n:
                self._recent[tuple(before[-n:])] = token

    def _after(self, history: tuple[int, ...]) -> int | None:
        token = self._recent.get(history)
        return self._older.get(history) if token is None else token

    def guess(self, tail: list[int], length: int) -> list[int]:
        """Up to `length` tokens the drafter would likely draft after `tail`."""
        tail, guessed = list(tail[-self.ORDERS[0] :]), []
        while len(guessed) < length:
            token = next((t for n in self.ORDERS if (t := self._after(tuple(tail[-n:]))) is not None), None)
            if token is None:
                break
            guessed.append(token)
            tail.append(token)
        return guessed


def continuation_tree(continuations: list[list[int]], budget: int, min_share: float) -> tuple[DraftTree, list[float]]:
    """The trie of `continuations`, cut to the `budget` nodes that the most of them pass
    through (at least `min_share` of them), and each kept node's share of them. A node's share
    is the empirical probability of its path given the match, and never exceeds its parent's,
    so the kept nodes form a tree."""
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
    kept = sorted(sorted((n for n in range(len(trie)) if counts[n] >= least), key=lambda n: (-counts[n], n))[:budget])
    return trie.subtree(kept), [counts[n] / len(continuations) for n in kept]


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
