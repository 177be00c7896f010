"""Text between two tokenizers: a drafter's own tokens for the verifier's committed context, and
the verifier's tokens for a draft the drafter made in its own (universal assisted decoding).

The verifier's tokens are decoded to text; the drafter's tokens are that text encoded again over
a window of left context, so its last tokens may change as text arrives (a word that grows, a
space that joins the next word): the drafter's cache rolls back to what they share. A draft goes
the other way: its text is encoded together with the committed text's tail, so its boundaries are
the verifier's own, and its last token, which the drafter may have cut mid-word, is dropped.

Nothing here touches a model or the verification: any draft is checked by the verifier, so the
mapping decides how much is accepted, never what is output."""
from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from specdec.core.tree import ROOT, DraftTree

INCOMPLETE = "\ufffd"  # what decoding shows for the bytes of a character not complete yet


@dataclass
class FollowedText:
    """One session's view of the committed context in both tokenizations."""

    verifier_tokens: list[int] = field(default_factory=list)
    text_ends: list[int] = field(default_factory=list)  # the text's length after each verifier token
    text: str = ""
    own_tokens: list[int] = field(default_factory=list)
    own_ends: list[int] = field(default_factory=list)  # where each own token ends in `text`
    rollbacks: int = 0  # times re-encoding changed own tokens the drafter had already read


class TokenizerBridge:
    """`own`: the drafter's tokenizer; `verifier`: the one whose ids cross the wire."""

    DECODE_WINDOW = 8  # verifier tokens decoded again before the new ones (a character may span tokens)
    ENCODE_WINDOW = 16  # own tokens encoded again before new text (merges reach back a few tokens)
    TAIL = 4  # committed verifier tokens a draft is encoded after

    def __init__(self, own: PreTrainedTokenizerBase, verifier: PreTrainedTokenizerBase):
        self.own, self.verifier = own, verifier
        self.verifier_special = set(verifier.all_special_ids)

    def follow(self, state: FollowedText, context: list[int]) -> list[int]:
        """Brings `state` to the verifier's `context` (which may drop tokens it followed: a wrong
        assumption) and returns the drafter's own tokens for it."""
        keep = common_prefix(state.verifier_tokens, context)
        if keep < len(state.verifier_tokens):
            del state.verifier_tokens[keep:], state.text_ends[keep:]
            state.text = state.text[: state.text_ends[-1] if keep else 0]
        if keep < len(context):
            self._decode_new(state, context[keep:])
        self._encode_tail(state)
        return state.own_tokens

    def _decode_new(self, state: FollowedText, new: list[int]) -> None:
        tokens = state.verifier_tokens
        start = max(0, len(tokens) - self.DECODE_WINDOW)
        before = state.text[state.text_ends[start - 1] if start else 0 :]
        if _text(self.verifier, tokens[start:]) != before:  # a tokenizer whose window decodes otherwise (a leading space)
            start, before = 0, state.text
        base = len(state.text) - len(before)
        for token in new:
            tokens.append(token)
            decoded = _text(self.verifier, tokens[start:])
            state.text_ends.append(base + len(decoded))
        state.text = state.text[:base] + decoded

    def _encode_tail(self, state: FollowedText) -> None:
        """Encodes the text after the last ENCODE_WINDOW own tokens again (all of it when the
        window's first token comes out otherwise: its start was no stable boundary)."""
        own, ends = state.own_tokens, state.own_ends
        while ends and ends[-1] > len(state.text):  # text the verifier's context dropped
            own.pop(), ends.pop()
        if ends and ends[-1] == len(state.text):
            return
        start = max(0, len(own) - self.ENCODE_WINDOW)
        cut = ends[start - 1] if start else 0
        tokens, token_ends = self._encode(state.text[cut:], cut)
        if start and (not tokens or tokens[0] != own[start]):
            start, tokens, token_ends = 0, *self._encode(state.text, 0)
        same = start + common_prefix(own[start:], tokens)
        if same < len(own):
            state.rollbacks += 1
        state.own_tokens, state.own_ends = own[:start] + tokens, ends[:start] + token_ends

    def _encode(self, text: str, offset: int) -> tuple[list[int], list[int]]:
        encoded = self.own(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoded["input_ids"], [offset + end for _, end in encoded["offset_mapping"]]

    def to_verifier(self, state: FollowedText, tree: DraftTree, budget: int) -> tuple[DraftTree, int]:
        """The verifier's tokens for `tree` (drafted in own tokens after state.own_tokens): every
        leaf's path becomes text, then verifier tokens, and the paths merge into one trie of at
        most `budget` nodes (the drafter's earlier nodes first). Children are distinct and carry
        no proposal: each is a point mass to the verifier, which keeps sampling exact. Also
        returns how many verifier tokens the leaves became before the budget and the dropped
        last tokens cut them (what the drafter's tokens are worth in the verifier's)."""
        anchor = state.own_tokens[-self.TAIL :]
        anchor_text = _text(self.own, anchor)
        tail = state.verifier_tokens[-self.TAIL :]
        tail_text = self.verifier.decode(tail, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        mapped, unbounded = DraftTree(), 0
        child_of: dict[tuple[int, int], int] = {}
        has_child = {p for p in tree.parent if p != ROOT}
        for leaf in (n for n in range(len(tree)) if n not in has_child):
            text = _text(self.own, anchor + [tree.token_ids[n] for n in tree.path_to(leaf)])
            if not text.startswith(anchor_text) or len(text) == len(anchor_text):
                continue
            node, tokens, dropped = ROOT, *self._verifier_tokens(tail, tail_text, text[len(anchor_text) :])
            unbounded += dropped
            for depth, token in enumerate(tokens):
                if (node, token) not in child_of:
                    if len(mapped) == budget:
                        unbounded += len(tokens) - depth
                        break
                    child_of[node, token] = mapped.add(token, node)
                    unbounded += 1
                node = child_of[node, token]
        return mapped, unbounded

    def _verifier_tokens(self, tail: list[int], tail_text: str, text: str) -> tuple[list[int], int]:
        """`text`'s verifier tokens after the committed `tail`, and how many were dropped: the
        last one unless it is a special token (text cut mid-word would give a token the
        verifier would not)."""
        encoded = self.verifier.encode(tail_text + text, add_special_tokens=False)
        if encoded[: len(tail)] == tail:
            tokens = encoded[len(tail) :]
        else:  # the text merges with the tail: the verifier, which ended the tail there, starts anew
            tokens = self.verifier.encode(text, add_special_tokens=False)
        if not tokens or tokens[-1] in self.verifier_special:
            return tokens, 0
        return tokens[:-1], 1


def _text(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """The text of `ids`, without the bytes of a last character not complete yet."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False).rstrip(INCOMPLETE)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading items the two lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
