"""What every mode of `specdec bench` reads: the config, the held-out prompts and the plans."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdec.bench.network import COLOCATED, SPLIT
from specdec.core.prompts import chat_ids, evaluation_split, load_prompts
from specdec.core.tree import TreeShape
from specdec.serving.cli_args import tree_overrides


@dataclass
class BenchSetup:
    config: Any  # specdec.serving.config.Config
    app_args: dict  # the Serve app's arguments every stack starts from
    tokenizer: Any
    prompts: list[dict]  # held-out Spec-Bench rows
    prompt_ids: list[list[int]]  # each prompt in the verifier's chat template
    temperatures: list[float]
    budgets: list[int]
    trees: list[str]
    shapes: dict[str, TreeShape]  # tree method -> the shape of its requests
    placements: list[str]  # split, colocated

    def described(self, max_new_tokens: int) -> dict:
        """The report's config fields every mode shares."""
        return {
            "verifier": self.config.verifier.model.__dict__, "drafter": self.config.drafter.model.__dict__,
            "max_new_tokens": max_new_tokens, "torch_threads": torch.get_num_threads(),
        }

    def question_ids(self) -> list:
        return [p["question_id"] for p in self.prompts]


def bench_setup(args) -> BenchSetup:
    """Reads and checks the command line's common inputs (a bad one exits with a message)."""
    from specdec.core.models import load_tokenizer
    from specdec.app import build_config

    shapes = {}
    for method in args.trees.split(","):
        try:
            shapes[method] = TreeShape(**{**tree_overrides(args), "method": method})
        except ValueError as err:
            raise SystemExit(f"--trees: {err}") from None
    categories = args.categories.split(",") if args.categories else None
    prompts = evaluation_split(load_prompts(args.prompts, categories), args.num_prompts, args.skip_prompts)
    if not prompts:
        raise SystemExit(f"no held-out prompts in {args.prompts} for categories={args.categories}")
    app_args = {"coordinator": {"port": args.port}, **({"config_file": args.config} if args.config else {})}
    config = build_config(app_args)
    tokenizer = load_tokenizer(config.verifier.model.source)
    placements = args.placements.split(",") if args.placements else [COLOCATED if config.coordinator.verifier_in_process else SPLIT]
    if unknown := set(placements) - {SPLIT, COLOCATED}:
        raise SystemExit(f"--placements: unknown placement {sorted(unknown)[0]!r}; use {SPLIT} or {COLOCATED}")
    return BenchSetup(
        config, app_args, tokenizer, prompts, [chat_ids(tokenizer, p["prompt"]) for p in prompts],
        [float(t) for t in args.temperature.split(",")], [int(b) for b in args.budgets.split(",")], list(shapes), shapes, placements,
    )
