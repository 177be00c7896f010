"""The oracle drafter, for measurement (specdec/core/oracle.py): it drafts the verifier alone's
recorded greedy continuation, through the plan's own tree builder, as a drafter sure of every
token (one token with probability 1 after each node): a chain of the plan's depth, which is
what a dynamic, static or beam tree makes of such a drafter, and half the budget deep for a
lattice. No model, like the n-gram drafter, with the same sessions, checks and API."""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import Any

import torch

from drafter_service.drafter import DrafterSession
from drafter_service.ngram_drafter import NgramDrafter
from drafter_service.tree_builders import NextToken, builder_for
from specdec.core.batching import Job
from specdec.core.models import ModelSpec
from specdec.core.oracle import ReferenceTable
from specdec.core.sampling import Sampling
from specdec.core.tree import ROOT, DraftTree, Proposal, TreeShape


@dataclass
class OracleSession(DrafterSession):
    reference: list[int] | None = None  # the recorded prompt and continuation; None = not a recorded prompt


class OracleDrafter(NgramDrafter):
    session_type = OracleSession

    def __init__(self, spec: ModelSpec, *args, **options):
        super().__init__(spec, *args, **options)
        self.table = ReferenceTable(spec.source)

    def _proposer(self, shape: TreeShape) -> None:
        return None  # it drafts no n-grams, whatever the request's tree.ngram

    def _new_session(self, context: list[int], sampling: Sampling) -> OracleSession:
        session = super()._new_session(context, sampling)
        session.reference = self.table.find(context)
        return session

    def _draft_after(
        self, session: OracleSession, context: list[int], shape: TreeShape, budget: int, pick: bool, pick_excludes: list[int],
        steering: torch.Tensor | None,
    ) -> Job:
        yield from ()  # a job that runs no forward
        reference = session.reference
        # Nothing to propose once the context leaves the reference (a sampled token) or passes its end.
        if reference is None or reference[: len(context)] != context or len(reference) <= len(context):
            return DraftTree(), 0.0, []
        if pick:  # overlapped drafting: its pick is the reference's next token
            if reference[len(context)] in pick_excludes or len(reference) == len(context) + 1:
                return DraftTree(), 0.0, []
            context.append(reference[len(context)])
        left = len(reference) - len(context)
        # No node past the reference's end: a builder would find no token to expand it with.
        shape = replace(shape, max_depth=min(shape.max_depth, left)) if shape.max_depth else shape
        start = len(context)

        def expand(tree: DraftTree, nodes: list[int]) -> Generator[Any, Any, list[NextToken]]:
            yield from ()
            return [_certain(reference[start + (0 if n == ROOT else len(tree.path_to(n)))]) for n in nodes]

        generator = None if session.sampling.greedy else session.generator
        return (yield from builder_for(shape).build(expand, min(budget, left), generator)), 0.0, []


def _certain(token: int) -> NextToken:
    """A distribution sure of `token`; sampled builders draw it from this point-mass proposal,
    which the verifier accepts with the target's own probability of the token."""
    return NextToken(torch.ones(1, dtype=torch.float64), torch.tensor([token]), Proposal([token], [1.0]))
