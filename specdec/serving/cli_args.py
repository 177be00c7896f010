"""Command-line flags shared by `specdec serve`, `generate` and `bench`."""
from __future__ import annotations

import argparse

from specdec.core.tree import NGRAM_METHODS, TREE_METHODS


def add_tree_arguments(parser: argparse.ArgumentParser, with_method: bool = True) -> None:
    """The draft-tree shape flags (common.proto TreeShape); unset flags keep the config's values."""
    if with_method:
        parser.add_argument("--tree", choices=TREE_METHODS, help="how the drafter spends the budget (default: the config's)")
    parser.add_argument("--tree-branching", help="static, rsd-c: children per node at depth 1, 2, ..., e.g. 4,2,2")
    parser.add_argument(
        "--tree-width", type=int, help="dynamic: nodes expanded per depth and children each; rsd-s: beam width; lattice: tokens per depth"
    )
    parser.add_argument("--tree-depth", type=int, help="deepest level drafted (0 = as deep as the budget allows)")
    parser.add_argument(
        "--ngram", choices=("none", *NGRAM_METHODS),
        help="n-gram candidates: merged into a drafter model's drafts (hybrid), or the drafts of a drafter without one "
        "(default: the drafter's)",
    )


def tree_overrides(args) -> dict:
    """The tree flags that were given, as a coordinator.tree config mapping."""
    given = {
        "method": getattr(args, "tree", None),
        "branching": [int(b) for b in args.tree_branching.split(",")] if args.tree_branching else None,
        "width": args.tree_width,
        "max_depth": args.tree_depth,
        "ngram": args.ngram,
    }
    return {k: v for k, v in given.items() if v is not None}


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, help="the cost model picks each round's budget")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, help="draft the next round while this one is verified")


def add_serve_steering_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steering", action=argparse.BooleanOptionalAction,
        help="SD²: whether requests steer the drafter by default when the pair can (default: yes)",
    )
    parser.add_argument(
        "--steering-checkpoint", metavar="DIR",
        help="SD² checkpoint both services load their halves of (default: the drafter's own directory when it is one made "
        "for this verifier; '' = none)",
    )
