"""Command-line flags for a training recipe dataclass: `--config recipe.yaml` plus one flag per
field (underscores become dashes); flags override the file. Shared by every training command."""
from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

import yaml

from specdec.serving.config import ConfigError, parse


def add_recipe_arguments(parser: argparse.ArgumentParser, recipe: type, list_help: dict[str, str]) -> None:
    """`list_help`: the list-valued fields (given comma-separated) and their help."""
    parser.add_argument("--config", help="YAML recipe (keys as the flags, with underscores); flags override it")
    types = typing.get_type_hints(recipe)
    for f in dataclasses.fields(recipe):
        flag = "--" + f.name.replace("_", "-")
        if f.name in list_help:
            parser.add_argument(flag, help=list_help[f.name])
        elif types[f.name] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, type=types[f.name] if types[f.name] in (int, float) else str, default=None)
    parser.set_defaults(recipe=recipe, list_fields=set(list_help))


def recipe_from_args(args):
    """The recipe the parsed flags (and their --config file) describe, validated."""
    data = {}
    if args.config:
        try:
            data = yaml.safe_load(Path(args.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"cannot read {args.config}: {err}") from None
    for f in dataclasses.fields(args.recipe):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        if f.name in args.list_fields:
            items = [x.strip() for x in value.split(",") if x.strip()]
            try:
                value = items if typing.get_type_hints(args.recipe)[f.name] == list[str] else [int(x) for x in items]
            except ValueError:
                raise ConfigError(f"--{f.name.replace('_', '-')} takes comma-separated integers, got '{value}'") from None
        data[f.name] = value
    return parse(args.recipe, data)
