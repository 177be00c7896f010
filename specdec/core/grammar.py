"""Structured outputs: a request's constraint (a JSON schema, a regex, a Lark grammar, a choice of
strings) compiled by llguidance (docs/structured.md says why that library) into a matcher over a
tokenizer, and what speculation does with it:

- the verifier masks each draft-tree row by the grammar state of that row's path, so acceptance
  (greedy or rejection sampling) follows the constrained distribution exactly (`mask_tree_rows`);
- the coordinator drops the draft nodes the grammar forbids (`prune_tree`) and drafts the tokens
  the grammar forces without any model (`GrammarState.forced`).

Pure over token ids and logits: no service, no model."""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from specdec.core.tree import ROOT, DraftTree

CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")
# JSON laid out as Python's json.dumps writes it: one line, ", " between items and ": " after keys.
# No whitespace is left to choose, so the grammar forces every key with its quotes and separators
# (34% of a function's description in Qwen2.5's tokens, against 9% with free whitespace, which
# also takes 21% more tokens), and no model can pad an answer with whitespace forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint that cannot be used; the message names the field at fault."""


@dataclass(frozen=True)
class Constraint:
    """What a request constrains its output to. `text`: the JSON schema (JSON), the regex, the
    Lark grammar, or the choices as a JSON list of strings; "" for json_object."""

    kind: str
    text: str = ""

    def source(self) -> str:
        """The llguidance grammar; ConstraintError where the constraint is malformed."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as err:
                raise ConstraintError(f"json_schema is not valid JSON: {err}") from None
            if not isinstance(schema, dict):
                raise ConstraintError("json_schema must be a JSON object (a schema)")
            return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        if self.kind == "grammar":
            return LLMatcher.grammar_from_lark(self.text)
        if self.kind == "choice":
            choices = json.loads(self.text)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ConstraintError("choice must list at least one non-empty string")
            # Lark string literals take JSON's escapes.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        raise ConstraintError(f"unknown constraint kind '{self.kind}'; expected one of {', '.join(CONSTRAINT_KINDS)}")


def constraint_from_proto(message) -> Constraint | None:
    """The common.Constraint message's constraint; None where none is set."""
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "choice":
        return Constraint("choice", json.dumps(list(message.choice.options)))
    return Constraint(kind, getattr(message, kind))


def constraint_to_proto(constraint: Constraint | None, message_type):
    """A common.Constraint message (of `message_type`) holding `constraint`."""
    message = message_type()
    if constraint is None:
        return message
    if constraint.kind == "json_object":
        message.json_object = True
    elif constraint.kind == "choice":
        message.choice.options.extend(json.loads(constraint.text))
    else:
        setattr(message, constraint.kind, constraint.text)
    return message


class Grammars:
    """Compiles constraints for one tokenizer (`vocab_size`: the model's logits, which may
    outnumber the tokenizer's tokens; `eos_ids`: the tokens that end a complete output). The
    tokenizer's setup (~1 s for 151,936 tokens) is paid once; compiled grammars are kept, the
    `cache_size` last used, and each request gets a copy (microseconds)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], max_bytes: int = 65536, cache_size: int = 64):
        self.vocab_size, self.max_bytes, self.cache_size = vocab_size, max_bytes, cache_size
        self._hf_tokenizer, self._eos_ids, self._tokenizer = tokenizer, sorted(eos_ids), None
        self._compiled: OrderedDict[Constraint, object] = OrderedDict()
        self._lock = threading.Lock()

    def _llg_tokenizer(self):
        """llguidance's view of the tokenizer, made on first use."""
        import llguidance.hf

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_ids)
            return self._tokenizer

    def state(self, constraint: Constraint) -> tuple[GrammarState, float]:
        """A fresh state of the constraint's grammar, and the ms compiling it took (0 when cached).
        ConstraintError names what is wrong with it."""
        from llguidance import LLMatcher

        if len(constraint.text.encode()) > self.max_bytes:
            raise ConstraintError(f"{constraint.kind} is {len(constraint.text.encode())} bytes; this server takes at most {self.max_bytes}")
        with self._lock:
            template = self._compiled.get(constraint)
            if template is not None:
                self._compiled.move_to_end(constraint)
                return GrammarState(template.deep_copy(), self.vocab_size), 0.0
        tokenizer = self._llg_tokenizer()  # once per process, outside the compile time
        start = time.perf_counter()
        source = constraint.source()
        error = LLMatcher.validate_grammar(source, tokenizer)
        if error:
            raise ConstraintError(f"{constraint.kind} does not compile: {error.strip()}")
        template = LLMatcher(tokenizer, source, log_level=0)
        if template.is_error():
            raise ConstraintError(f"{constraint.kind} does not compile: {template.get_error()}")
        compile_ms = (time.perf_counter() - start) * 1e3
        with self._lock:
            self._compiled[constraint] = template
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return GrammarState(template.deep_copy(), self.vocab_size), compile_ms


class GrammarState:
    """Where a constrained output stands: the tokens its grammar allows next."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def copy(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy(), self.vocab_size)

    def advance(self, tokens: list[int]) -> bool:
        """Consumes `tokens`; False (and the state unusable) where the grammar forbids one."""
        return self.matcher.consume_tokens(list(tokens))

    def allowed(self) -> torch.Tensor:
        """The tokens allowed next, as a boolean mask over the vocabulary."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool))

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (its one way on), in the
        tokenizer's own tokenization; [] where it leaves a choice or is done."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()[:limit]


def mask_rows(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits with every token the mask forbids at -inf (a copy; the row's others untouched,
    so the constrained distribution is the renormalised unconstrained one on the allowed set)."""
    return logits.masked_fill(~allowed[..., : logits.shape[-1]], float("-inf"))


def mask_tree_rows(logits: torch.Tensor, tree: DraftTree, state: GrammarState) -> torch.Tensor:
    """Tree verification's logits (row 0: after the committed context; row 1 + i: after node i)
    with each row masked by the grammar state of its path. A row whose path the grammar forbids
    is left as it is: its node is rejected before anything reads it (its token has probability 0)."""
    masked = logits.clone()
    for node, at in prune_tree(tree, state)[1].items():
        row = 0 if node == ROOT else 1 + node
        masked[row] = mask_rows(logits[row], at.allowed())
    return masked


def prune_tree(tree: DraftTree, state: GrammarState) -> tuple[list[int], dict[int, GrammarState]]:
    """The nodes of `tree` worth verifying under the grammar (ascending, parents first), and the
    grammar's state after each allowed one: those whose whole path it allows, so no verify row
    is spent on a token the verifier could never accept. A forbidden child drawn from its
    parent's proposal stays, as a leaf: recursive rejection sampling's rejection of it moves the
    residual distribution its later siblings are tried against (a point-mass child's rejection
    changes nothing, so it goes)."""
    states, kept = {ROOT: state}, []
    for node, (token, parent) in enumerate(zip(tree.token_ids, tree.parent)):
        if parent not in states:
            continue
        child = states[parent].copy()
        if child.advance([token]):
            states[node] = child
            kept.append(node)
        elif parent in tree.proposals:
            kept.append(node)
    return kept, states


@dataclass
class ConstrainedDraft:
    tree: DraftTree
    kept: list[int]  # the draft's nodes kept, as they follow the forced chain in `tree`
    tail: int  # forced tokens appended below the draft's deepest path
    forced: set[int]  # the nodes of `tree` the grammar forced (the chain before the draft, the tail)


def constrain_draft(draft: DraftTree, state: GrammarState, forced: list[int], max_depth: int) -> ConstrainedDraft:
    """A draft made after the `forced` tokens, as the verifier gets it under the grammar (at
    `state`, before them): below a chain of the forced tokens, without the nodes the grammar
    forbids (`prune_tree`), and its deepest path (a point-mass node's) continued by the tokens the
    grammar forces after it, no node deeper than `max_depth`: a drafter's chain that ends where
    structure begins (a string's closing quote) goes on through the structure."""
    after = state.copy()
    after.advance(forced)
    kept, states = prune_tree(draft, after)
    depth = {ROOT: 0}
    for node in kept:
        depth[node] = depth[draft.parent[node]] + 1
    leaves = [n for n in kept if n in states and n not in draft.proposals and not any(draft.parent[m] == n for m in kept)]
    leaf = max(leaves, key=lambda n: (depth[n], -n), default=None)
    tail = states[leaf].forced(max_depth - len(forced) - depth[leaf]) if leaf is not None else []
    tree = below_forced(forced, draft.subtree(kept))
    k = len(forced)
    for i, token in enumerate(tail):
        tree.add(token, k + kept.index(leaf) if i == 0 else len(tree) - 1)
    return ConstrainedDraft(tree, kept, len(tail), set(range(k)) | set(range(len(tree) - len(tail), len(tree))))


def below_forced(forced: list[int], tree: DraftTree) -> DraftTree:
    """`tree` (drafted after the forced tokens) hung below a chain of them: point-mass nodes,
    which the verifier accepts with the probability it gives them."""
    k = len(forced)

    def shift(node: int) -> int:
        return k - 1 if node == ROOT else node + k

    return DraftTree(
        list(forced) + tree.token_ids, list(range(-1, k - 1)) + [shift(p) for p in tree.parent],
        {shift(n): q for n, q in tree.proposals.items()},
    )
