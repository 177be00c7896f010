"""The oracle drafter's reference table: the verifier alone's own greedy continuation of each
benchmark prompt. `specdec bench --drafters oracle` records it through the stack, and the oracle
drafter (drafter_service/oracle_drafter.py) proposes it: what its rows keep is the most any
drafter could keep with each plan. A benchmark drafter only: `specdec serve` refuses it."""
from __future__ import annotations

import json
from pathlib import Path

ORACLE = "oracle"  # the --drafters entry
REFERENCES_FILE = "oracle_references.json"
NOT_SERVED = (
    "the oracle drafter is a benchmark drafter: it proposes the verifier alone's own continuations of the "
    "benchmark's prompts, recorded first by `specdec bench --drafters oracle,...`, and cannot serve other "
    "requests; name a drafter model, prompt-lookup or suffix"
)


def is_oracle(source: str) -> bool:
    """The drafter source names the oracle, or is a directory holding a reference table."""
    return source == ORACLE or (Path(source) / REFERENCES_FILE).is_file()


def write_references(directory: Path, references: list[tuple[list[int], list[int]]]) -> None:
    """Writes (prompt token ids, the verifier alone's continuation) pairs as the table in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": list(prompt), "continuation": list(continuation)} for prompt, continuation in references]
    temporary = directory / (REFERENCES_FILE + ".tmp")
    temporary.write_text(json.dumps({"references": rows}))
    temporary.replace(directory / REFERENCES_FILE)  # a reader never sees half a table


class ReferenceTable:
    """The references of one table directory, looked up by a session's context."""

    def __init__(self, directory: str):
        self.path = Path(directory) / REFERENCES_FILE
        self.references: list[tuple[int, list[int]]] = []  # (prompt length, prompt + continuation)

    def find(self, context: list[int]) -> list[int] | None:
        """The recorded sequence (prompt, then the verifier's continuation) whose prompt
        `context` holds whole and goes on along; None when there is none. The bench starts its
        stacks before it records the references through one of them, so a context the table
        lacks makes it read the table again."""
        match = self._match(context)
        if match is None:
            rows = json.loads(self.path.read_text())["references"]
            self.references = [(len(row["prompt"]), row["prompt"] + row["continuation"]) for row in rows]
            match = self._match(context)
        return match

    def _match(self, context: list[int]) -> list[int] | None:
        return next((s for n, s in self.references if n <= len(context) and s[: len(context)] == context), None)
