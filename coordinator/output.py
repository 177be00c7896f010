"""Turning committed tokens into the client's output: EOS, max_new_tokens, stop strings,
incremental text that never sends half a character or the start of a stop string, and the
text's spans by where its tokens came from (accepted drafts or the verifier's own)."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class OutputTracker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: set[int], stop: list[str], max_new_tokens: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.stop = stop
        self.max_new_tokens = max_new_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason = ""
        self._sent_tokens = 0
        self._sent_chars = 0
        self._span_ends: list[tuple[int, int, bool]] = []  # (end char, tokens, drafted) over self.text
        self._sent_spans = 0

    def add(self, tokens: list[int], drafted: int = 0) -> int:
        """Takes one round's tokens, the first `drafted` of them accepted drafts; returns how
        many were kept (fewer past an EOS, a stop string or the length limit)."""
        start = len(self.token_ids)
        self._add(tokens)
        kept = len(self.token_ids) - start
        drafted = min(drafted, kept)
        if drafted and kept > drafted:  # where the drafts' text ends: one more decode
            boundary = len(self.tokenizer.decode(self.token_ids[: start + drafted], skip_special_tokens=True))
            self._mark(boundary, drafted, True)
            self._mark(len(self.text), kept - drafted, False)
        elif kept:
            self._mark(len(self.text), kept, drafted > 0)
        return kept

    def _mark(self, end: int, tokens: int, drafted: bool) -> None:
        last = self._span_ends[-1][0] if self._span_ends else 0
        self._span_ends.append((min(max(end, last), len(self.text)), tokens, drafted))

    def _add(self, tokens: list[int]) -> None:
        """Takes one round's tokens, stopping at the first EOS, stop string or length limit.
        The output is decoded once a round (decoding it after every token cost the
        coordinator more than anything else it does); only a round whose text holds a stop
        string is decoded again token by token, to end at the token that completed it."""
        if self.finish_reason:
            return
        start = len(self.token_ids)
        tokens = tokens[: self.max_new_tokens - start]
        eos = next((i for i, token in enumerate(tokens) if token in self.eos_ids), None)
        if eos is not None:
            tokens = tokens[: eos + 1]
        self.token_ids.extend(tokens)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._stop_position(self.text)
        if cut is not None:
            for end in range(start + 1, len(self.token_ids) + 1):
                text = self.tokenizer.decode(self.token_ids[:end], skip_special_tokens=True)
                cut = self._stop_position(text)
                if cut is not None:
                    del self.token_ids[end:]
                    self.text = text[:cut]
                    break
            self.finish_reason = "stop"
        elif eos is not None:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = "length"

    def end(self, reason: str) -> None:
        self.finish_reason = self.finish_reason or reason

    def take_delta(self) -> tuple[list[int], str, list[tuple[int, int, bool]]]:
        """What the client has not been sent yet, holding back text that may still change:
        (tokens, text, the text's spans as (chars, tokens, drafted))."""
        safe = len(self.text) if self.finish_reason else self._safe_length()
        tokens = self.token_ids[self._sent_tokens :]
        start = self._sent_chars
        text = self.text[start : max(safe, start)]
        self._sent_tokens = len(self.token_ids)
        self._sent_chars += len(text)
        return tokens, text, self._take_spans(start, self._sent_chars)

    def _take_spans(self, start: int, end: int) -> list[tuple[int, int, bool]]:
        """The spans' pieces within text[start:end]; a span's tokens go with its last piece.
        A stop string may have cut the text short of spans marked before it: they end at the cut."""
        spans = []
        while self._sent_spans < len(self._span_ends):
            span_end, tokens, drafted = self._span_ends[self._sent_spans]
            span_end = min(span_end, len(self.text))
            chars = min(span_end, end) - start
            if span_end > end:
                if chars > 0:
                    spans.append((chars, 0, drafted))
                break
            spans.append((max(chars, 0), tokens, drafted))
            start = max(start, span_end)
            self._sent_spans += 1
        return spans

    def _stop_position(self, text: str) -> int | None:
        positions = [text.find(s, max(0, self._sent_chars - len(s))) for s in self.stop]
        found = [p for p in positions if p >= 0]
        return min(found) if found else None

    def _safe_length(self) -> int:
        safe = len(self.text)
        if self.text.endswith("\ufffd"):  # an incomplete UTF-8 sequence
            safe -= 1
        for s in self.stop:  # a stop string may be starting at the end
            for n in range(min(len(s) - 1, safe), 0, -1):
                if self.text[:safe].endswith(s[:n]):
                    safe -= n
                    break
        return safe
