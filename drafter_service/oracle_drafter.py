"""The oracle drafter, for measurement (specdec/core/oracle.py): it drafts the verifier alone's
recorded greedy continuation, through the plan's own tree builder, as a drafter sure of every
token (one token with probability 1 after each node): a chain of the plan's depth, which is
what a dynamic, static or beam tree makes of such a drafter, and half the budget deep for a
lattice. No model, like the n-gram drafter."""
from __future__ import annotations

from dataclasses import replace

import torch

from drafter_service.drafting import Drafter, DrafterInfo, DrafterSession, ScoredTree
from drafter_service.tree_builders import NextToken, builder_for
from specdec.core.batching import Job, forwardless
from specdec.core.oracle import ReferenceTable
from specdec.core.sampling import Sampling
from specdec.core.tree import ROOT, DraftTree, Proposal, TreeShape


class OracleDrafter(Drafter):
    """It drafts no n-grams, whatever a request's tree.ngram. A session's state is its
    reference: the recorded prompt and continuation (None = not a recorded prompt)."""

    def __init__(self, source: str):
        self.table, self.info = ReferenceTable(source), DrafterInfo()

    def new_state(self, context: list[int], sampling: Sampling) -> list[int] | None:
        return self.table.find(context)

    def _next(self, session: DrafterSession, context: list[int]) -> int | None:
        """The reference's token after `context`; None once the context leaves the reference
        (a sampled token) or reaches its end."""
        reference = session.state
        if reference is None or reference[: len(context)] != context or len(reference) <= len(context):
            return None
        return reference[len(context)]

    @forwardless
    def pick(self, session: DrafterSession, context: list[int], shape: TreeShape, excludes: list[int]) -> int | None:
        token = self._next(session, context)
        # No pick where the reference ends right after it: nothing would be left to draft.
        return None if token in excludes or len(session.state or ()) == len(context) + 1 else token

    def draft(self, session: DrafterSession, context: list[int], shape: TreeShape, budget: int) -> Job:
        reference = session.state
        if self._next(session, context) is None:
            return ScoredTree(DraftTree(), [])
        left = len(reference) - len(context)
        # No node past the reference's end: a builder would find no token to expand it with.
        shape = replace(shape, max_depth=min(shape.max_depth, left)) if shape.max_depth else shape
        start = len(context)

        @forwardless
        def expand(tree: DraftTree, nodes: list[int]) -> list[NextToken]:
            return [_certain(reference[start + (0 if n == ROOT else len(tree.path_to(n)))]) for n in nodes]

        generator = None if session.sampling.greedy else session.generator
        return ScoredTree((yield from builder_for(shape).build(expand, min(budget, left), generator)), [])


def _certain(token: int) -> NextToken:
    """A distribution sure of `token`; sampled builders draw it from this point-mass proposal,
    which the verifier accepts with the target's own probability of the token."""
    return NextToken(torch.ones(1, dtype=torch.float64), torch.tensor([token]), Proposal([token], [1.0]))
