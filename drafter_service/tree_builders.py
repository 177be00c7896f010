"""Draft-tree builders: one small class per method behind one interface.

A builder decides which nodes to expand and which children to keep; the drafter model
answers `expand`, which feeds nodes through the model and returns each one's next-token
distribution. Both are steps of a batching job (specdec/core/batching.py): `expand` yields the
forward passes it needs, so `dists = yield from expand(tree, nodes)`, and `build` returns the
tree when its generator ends. The drafts of many sessions then share each forward. Sampled
children carry the proposal they were drawn from (without
replacement, in the order drawn); deterministic children carry none, which the verifier
reads as point-mass proposals. Either way verification stays exact.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from specdec.core.tree import ROOT, TREE_METHODS, DraftTree, Proposal, TreeShape


@dataclass
class NextToken:
    """The drafter's distribution after one node: token tokens[i] (token i where tokens is
    None) has probability probs[i], float64. A drafter with a reduced vocabulary keeps only
    that vocabulary's entries (8,192 instead of 49,152 for the built-in drafters). Sampled
    drafts also carry the sparse proposal the verifier rebuilds the same distribution from."""

    probs: torch.Tensor
    tokens: torch.Tensor | None = None
    proposal: Proposal | None = None

    def top(self, k: int) -> list[tuple[int, float]]:
        """The k likeliest tokens with non-zero probability and their probabilities, likeliest first."""
        top = torch.topk(self.probs, min(k, self.probs.shape[-1]))
        ids = top.indices if self.tokens is None else self.tokens[top.indices]
        return [(t, p) for t, p in zip(ids.tolist(), top.values.tolist()) if p > 0]

    def possible(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens with non-zero probability, and their probabilities."""
        keep = torch.nonzero(self.probs > 0).flatten()
        return (keep if self.tokens is None else self.tokens[keep]), self.probs[keep]


# expand(tree, nodes): a generator yielding forward passes, whose value is the next-token
# distribution after each node (ROOT included).
Expand = Callable[[DraftTree, list[int]], Generator[Any, Any, list[NextToken]]]
# rescore(path so far, [(token, the drafter's log-probability of it)]) -> each token's score there.
Rescore = Callable[[list[int], list[tuple[int, float]]], list[float]]


class TreeBuilder(ABC):
    @abstractmethod
    def build(self, expand: Expand, budget: int, rng: torch.Generator | None) -> Generator[Any, Any, DraftTree]:
        """A tree of at most `budget` nodes (the generator's value; it yields what `expand`
        yields). rng is None for greedy decoding, when every choice is deterministic (the
        drafter's top tokens)."""


def gumbel(shape: int, rng: torch.Generator) -> torch.Tensor:
    u = torch.rand(shape, generator=rng, dtype=torch.float64).clamp_min(1e-300)
    return -torch.log(-torch.log(u))


def sample_without_replacement(dist: NextToken, k: int, rng: torch.Generator) -> list[int]:
    """Gumbel-Top-k: k distinct tokens in the order sequential draws without replacement
    would give them."""
    tokens, probs = dist.possible()
    keys = probs.log() + gumbel(len(tokens), rng)
    order = torch.argsort(keys, descending=True)[:k]
    return tokens[order].tolist()


class KaryTree(TreeBuilder):
    """A fixed shape: every node at depth d gets branching[d] children (1 past the list),
    breadth first until the budget is spent. `sampled` draws the children without
    replacement (RSD-C; a chain when every branching is 1); otherwise they are the
    drafter's top tokens (a static tree)."""

    def __init__(self, branching: list[int], sampled: bool, max_depth: int):
        self.branching = branching
        self.sampled = sampled
        self.max_depth = max_depth

    def build(self, expand: Expand, budget: int, rng: torch.Generator | None) -> Generator[Any, Any, DraftTree]:
        tree = DraftTree()
        level, depth = [ROOT], 0
        while level and len(tree) < budget and depth < (self.max_depth or budget):
            width = self.branching[depth] if depth < len(self.branching) else 1
            parents = level[: math.ceil((budget - len(tree)) / width)]
            next_level = []
            for parent, dist in zip(parents, (yield from expand(tree, parents))):
                k = min(width, budget - len(tree))
                if self.sampled and rng is not None:
                    tokens = sample_without_replacement(dist, k, rng)
                    tree.proposals[parent] = dist.proposal
                else:
                    tokens = [token for token, _ in dist.top(k)]
                next_level += [tree.add(token, parent) for token in tokens]
            level, depth = next_level, depth + 1
        return tree


class DynamicTree(TreeBuilder):
    """EAGLE-2: at each depth expand the `width` candidates with the highest cumulative
    draft log-probability, each into its top `width` children; finally keep the best
    `budget` candidates overall. A child never outscores its parent, so the kept set
    contains every kept node's parent, and drafting stops once no deeper node could
    make the cut."""

    def __init__(self, width: int, max_depth: int):
        self.width = width
        self.max_depth = max_depth

    def build(self, expand: Expand, budget: int, rng: torch.Generator | None) -> Generator[Any, Any, DraftTree]:
        candidates, score = DraftTree(), []
        frontier = [ROOT]
        for _ in range(self.max_depth or budget):
            if len(score) >= budget and max(score[n] for n in frontier) < sorted(score, reverse=True)[budget - 1]:
                break
            new = []
            for parent, dist in zip(frontier, (yield from expand(candidates, frontier))):
                base = 0.0 if parent == ROOT else score[parent]
                for token, prob in dist.top(self.width):
                    new.append(candidates.add(token, parent))
                    score.append(base + math.log(prob))
            frontier = sorted(new, key=lambda n: -score[n])[: self.width]
        best = sorted(range(len(candidates)), key=lambda n: (-score[n], n))[:budget]
        return candidates.subtree(sorted(best))


class StochasticBeamTree(TreeBuilder):
    """RSD-S: stochastic beam search (Kool et al. 2019) over sequences. Each depth keeps
    the `width` children with the largest Gumbel-perturbed sequence log-probabilities,
    conditioned on their parent's key. Each parent's kept children are then a prefix of
    one without-replacement draw from its proposal, and unlikely branches end early.
    Greedy decoding makes it a plain beam search."""

    def __init__(self, width: int, max_depth: int):
        self.width = width
        self.max_depth = max_depth

    def build(self, expand: Expand, budget: int, rng: torch.Generator | None) -> Generator[Any, Any, DraftTree]:
        tree = DraftTree()
        logp, key = {ROOT: 0.0}, {ROOT: 0.0}  # sequence log-prob and its perturbed key
        beam, depth = [ROOT], 0
        while beam and len(tree) < budget and depth < (self.max_depth or budget):
            choices = []  # (key, parent, token, logp)
            for parent, dist in zip(beam, (yield from expand(tree, beam))):
                if rng is None:
                    top = dist.top(self.width)
                    tokens, probs = (
                        torch.tensor([t for t, _ in top], dtype=torch.long), torch.tensor([p for _, p in top], dtype=torch.float64)
                    )
                else:
                    tokens, probs = dist.possible()
                    tree.proposals[parent] = dist.proposal
                child_logp = logp[parent] + probs.log()
                child_key = child_logp if rng is None else conditioned_gumbel(child_logp, key[parent], rng)
                choices += [(float(k), parent, int(t), float(lp)) for k, t, lp in zip(child_key, tokens, child_logp)]
            chosen = sorted(choices, key=lambda c: -c[0])[: min(self.width, budget - len(tree))]
            kept_parents = {c[1] for c in chosen}
            tree.proposals = {n: q for n, q in tree.proposals.items() if n not in beam or n in kept_parents}
            next_beam = []
            for parent in beam:  # siblings in the order they were drawn
                for k, _, token, lp in (c for c in chosen if c[1] == parent):
                    node = tree.add(token, parent)
                    logp[node], key[node] = lp, k
                    next_beam.append(node)
            beam, depth = next_beam, depth + 1
        return tree


class LatticeTree(TreeBuilder):
    """Blockwise parallel decoding's refinement (Kim et al.): the drafter drafts a chain of
    `depth` tokens, and its `width` likeliest tokens at each depth, all conditioned on the
    chain, form a lattice. Paths through it are scored by the drafter's log-probabilities or,
    with `rescore`, by log-probabilities that mix in an n-gram LM's (the context's own
    phrasing), searched with a beam of `budget` prefixes; the `budget` best-scored prefixes
    form the tree. It costs the drafter
    the chain's forwards; the other branches are free guesses. Deterministic (point-mass) nodes,
    so exact for sampling too. Depth: `max_depth`, else half the budget."""

    def __init__(self, width: int, max_depth: int, rescore: Rescore | None):
        self.width = width
        self.max_depth = max_depth
        self.rescore = rescore

    def build(self, expand: Expand, budget: int, rng: torch.Generator | None) -> Generator[Any, Any, DraftTree]:
        chain, lattice = DraftTree(), []
        node = ROOT
        for _ in range(self.max_depth or max(1, budget // 2)):
            dist = (yield from expand(chain, [node]))[0]
            lattice.append([(token, math.log(prob)) for token, prob in dist.top(self.width)])
            node = chain.add(lattice[-1][0][0], node)
        tree, score, path = DraftTree(), [], {ROOT: []}
        beam = [ROOT]
        for candidates in lattice:
            grown = []
            for parent in beam:
                base = score[parent] if parent != ROOT else 0.0
                scores = self.rescore(path[parent], candidates) if self.rescore else [logq for _, logq in candidates]
                for (token, _), token_score in zip(candidates, scores):
                    child = tree.add(token, parent)
                    path[child] = path[parent] + [token]
                    score.append(base + token_score)
                    grown.append(child)
            beam = sorted(grown, key=lambda n: (-score[n], n))[:budget]
        # Scores only fall along a path, so the best `budget` nodes include their parents.
        best = sorted(range(len(tree)), key=lambda n: (-score[n], n))[:budget]
        return tree.subtree(sorted(best))


def conditioned_gumbel(logp: torch.Tensor, parent_key: float, rng: torch.Generator) -> torch.Tensor:
    """Gumbel(logp) keys conditioned on their maximum being parent_key (Kool et al. 2019,
    appendix B, in its numerically stable form). A monotone map of the unconditioned keys."""
    perturbed = logp + gumbel(len(logp), rng)
    top = perturbed.max()
    v = parent_key - perturbed + _log1mexp(perturbed - top)
    return parent_key - v.clamp_min(0.0) - torch.log1p(torch.exp(-v.abs()))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0."""
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def builder_for(shape: TreeShape, rescore: Rescore | None = None) -> TreeBuilder:
    """The builder of shape.method; `rescore` is lattice-ngram's n-gram LM over the context."""
    builders: dict[str, Callable[[], TreeBuilder]] = {
        "chain": lambda: KaryTree([1], sampled=True, max_depth=shape.max_depth),
        "static": lambda: KaryTree(shape.branching, sampled=False, max_depth=shape.max_depth),
        "rsd-c": lambda: KaryTree(shape.branching, sampled=True, max_depth=shape.max_depth),
        "dynamic": lambda: DynamicTree(shape.width, shape.max_depth),
        "rsd-s": lambda: StochasticBeamTree(shape.width, shape.max_depth),
        "lattice": lambda: LatticeTree(shape.width, shape.max_depth, None),
        "lattice-ngram": lambda: LatticeTree(shape.width, shape.max_depth, rescore),
    }
    assert set(builders) == set(TREE_METHODS)
    return builders[shape.method]()
