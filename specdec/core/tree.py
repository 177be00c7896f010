"""Draft trees in flat form (token_ids[] + parent[]) and the tensors that verify them."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

ROOT = -1
TREE_METHODS = ("chain", "static", "dynamic", "rsd-c", "rsd-s", "lattice", "lattice-ngram")
NGRAM_METHODS = ("prompt-lookup", "suffix")  # drafting without a model (specdec/core/ngram.py)


class MalformedTree(ValueError):
    """A draft tree that cannot be verified; the message says what is wrong."""


@dataclass
class Proposal:
    """A sparse draft distribution: the probabilities of a few token ids, summing to 1."""

    token_ids: list[int]
    probs: list[float]

    def dense(self, vocab_size: int) -> torch.Tensor:
        q = torch.zeros(vocab_size, dtype=torch.float64)
        q[torch.tensor(self.token_ids, dtype=torch.long)] = torch.tensor(self.probs, dtype=torch.float64)
        return q / q.sum()


@dataclass
class DraftTree:
    token_ids: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    # Node index (ROOT for the root) -> the distribution its children were drawn from.
    # A node without one has deterministically chosen children (point-mass proposals).
    proposals: dict[int, Proposal] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.token_ids)

    def add(self, token: int, parent: int) -> int:
        self.token_ids.append(token)
        self.parent.append(parent)
        return len(self.token_ids) - 1

    def subtree(self, nodes: list[int]) -> "DraftTree":
        """The tree of `nodes` (ascending, closed under taking parents), renumbered."""
        index = {ROOT: ROOT} | {old: new for new, old in enumerate(nodes)}
        return DraftTree(
            [self.token_ids[n] for n in nodes],
            [index[self.parent[n]] for n in nodes],
            {index[n]: q for n, q in self.proposals.items() if n in index},
        )

    def path_to(self, node: int) -> list[int]:
        """The nodes from a child of the root down to `node`."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parent[node]
        return path[::-1]

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parent) if p == node]

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        depth: list[int] = []
        for p in self.parent:
            depth.append(1 if p == ROOT else depth[p] + 1)
        return depth

    def ancestor_mask(self) -> torch.Tensor:
        """mask[i, j] is True when node j is node i or one of its ancestors."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parent):
            if p != ROOT:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def validate(self, vocab_size: int) -> None:
        if len(self.parent) != len(self.token_ids):
            raise MalformedTree(
                f"tree.parent has {len(self.parent)} entries but tree.token_ids has {len(self.token_ids)}"
            )
        for i, (tok, p) in enumerate(zip(self.token_ids, self.parent)):
            if not 0 <= tok < vocab_size:
                raise MalformedTree(f"tree.token_ids[{i}] = {tok} is outside the vocabulary [0, {vocab_size})")
            if not (p == ROOT or 0 <= p < i):
                raise MalformedTree(f"tree.parent[{i}] = {p} must be -1 (the root) or an earlier node index")
        for node, proposal in self.proposals.items():
            if not (node == ROOT or 0 <= node < len(self)):
                raise MalformedTree(f"tree.expanded_nodes names node {node}, which is not in the tree")
            _validate_proposal(node, proposal, vocab_size)
            support = set(proposal.token_ids)
            siblings = [self.token_ids[c] for c in self.children(node)]
            if len(set(siblings)) != len(siblings):
                raise MalformedTree(
                    f"tree.token_ids: the children of node {node} repeat a token; sampled siblings are drawn without replacement"
                )
            missing = [t for t in siblings if t not in support]
            if missing:
                raise MalformedTree(f"tokens {missing} under node {node} have no probability in its proposal")


MAX_DRAFT_NODES = 64  # the largest node budget of one draft, unless limits.max_draft_tokens says otherwise


@dataclass
class TreeShape:
    """How a drafter spends its node budget (see common.proto TreeShape)."""

    method: str = "dynamic"  # EAGLE-2: the best plan measured on the default pair (docs/benchmark.md)
    branching: list[int] = field(default_factory=lambda: [4, 2, 2])  # static, rsd-c
    width: int = 4  # dynamic: expanded per depth and children each; rsd-s: beam width; lattice: tokens per depth
    max_depth: int = 0  # the deepest level drafted; 0 = as deep as the budget allows
    # n-gram candidates: "" = the drafter's default (drafter.ngram.method), "none", or one of
    # NGRAM_METHODS (with a drafter model: hybrid drafts; without one: the only drafts)
    ngram: str = ""

    def __post_init__(self) -> None:
        """Checked wherever a shape is made (a config, a request, a bench's sweep): raises
        ValueError naming the field that is out of range."""
        if self.method not in TREE_METHODS:
            raise ValueError(f"method must be one of {', '.join(TREE_METHODS)}, got '{self.method}'")
        if not self.branching or any(b < 1 for b in self.branching):
            raise ValueError(f"branching must list integers >= 1, got {self.branching[:8]}{'...' if len(self.branching) > 8 else ''}")
        if self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")
        if self.max_depth < 0:
            raise ValueError(f"max_depth must be >= 0 (0 = up to the budget), got {self.max_depth}")
        if self.ngram not in ("", "none", *NGRAM_METHODS):
            raise ValueError(f"ngram must be '', none, {' or '.join(NGRAM_METHODS)}, got '{self.ngram}'")

    def check_limit(self, cap: int) -> None:
        """Raises ValueError when the shape asks for more than a draft of at most `cap` nodes
        (limits.max_draft_tokens) can hold: a larger width, branching or depth means nothing,
        and is refused before a builder could spend time on it (a dynamic tree ranks width^2
        candidates per depth)."""
        if len(self.branching) > cap or max(self.branching) > cap:
            raise ValueError(
                f"branching must list 1 to {cap} integers in [1, {cap}], "
                f"got {self.branching[:8]}{'...' if len(self.branching) > 8 else ''}"
            )
        if self.width > cap:
            raise ValueError(f"width must be in [1, {cap}], got {self.width}")
        if self.max_depth > cap:
            raise ValueError(f"max_depth must be in [0, {cap}] (0 = up to the budget), got {self.max_depth}")


def _validate_proposal(node: int, proposal: Proposal, vocab_size: int) -> None:
    where = f"tree.proposal for node {node}"
    if len(proposal.token_ids) != len(proposal.probs):
        raise MalformedTree(f"{where} has {len(proposal.token_ids)} token_ids but {len(proposal.probs)} probs")
    if not proposal.token_ids:
        raise MalformedTree(f"{where} is empty")
    if len(set(proposal.token_ids)) != len(proposal.token_ids):
        raise MalformedTree(f"{where} repeats a token id")
    if any(not 0 <= t < vocab_size for t in proposal.token_ids):
        raise MalformedTree(f"{where} has token ids outside the vocabulary [0, {vocab_size})")
    probs = torch.tensor(proposal.probs, dtype=torch.float64)
    if not torch.isfinite(probs).all() or (probs < 0).any() or (probs > 1).any():
        raise MalformedTree(f"{where}: probs must be finite numbers in [0, 1]")
    total = float(probs.sum())
    if abs(total - 1.0) > 1e-3:
        raise MalformedTree(f"{where}: probs sum to {total:.6f}, not 1")


def verification_inputs(
    tree: DraftTree, num_cached: int, num_pending: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and the 4-D boolean attention mask for one verification pass.

    The pass feeds the `num_pending` committed tokens not yet in the KV cache (the last of
    them is the tree's root) followed by the tree nodes. Pending tokens attend causally;
    each node attends to the whole committed context, its ancestors and itself.
    """
    root_pos = num_cached + num_pending - 1
    n = len(tree)
    positions = list(range(num_cached, num_cached + num_pending)) + [root_pos + d for d in tree.depths()]
    q_len, kv_len = num_pending + n, num_cached + num_pending + n
    mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
    mask[:, :num_cached] = True
    mask[:num_pending, num_cached : num_cached + num_pending] = torch.ones(
        num_pending, num_pending, dtype=torch.bool
    ).tril()
    mask[num_pending:, num_cached : num_cached + num_pending] = True
    mask[num_pending:, num_cached + num_pending :] = tree.ancestor_mask()
    return torch.tensor([positions]), mask[None, None]


def node_inputs(tree: DraftTree, cached_nodes: list[int], new_nodes: list[int], num_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and the 4-D boolean mask to feed `new_nodes` to a cache holding the
    `num_context` committed tokens (the last is the root) then `cached_nodes`, in order.
    Each new node sees the committed context, its ancestors and itself."""
    ancestors = tree.ancestor_mask()
    depths = tree.depths()
    columns = torch.tensor(cached_nodes + new_nodes, dtype=torch.long)
    rows = torch.tensor(new_nodes, dtype=torch.long)
    mask = torch.cat(
        [torch.ones(len(new_nodes), num_context, dtype=torch.bool), ancestors[rows][:, columns]], dim=1
    )
    positions = torch.tensor([[num_context - 1 + depths[n] for n in new_nodes]])
    return positions, mask[None, None]
