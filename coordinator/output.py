"""Turning committed tokens into the client's output: EOS, max_new_tokens, stop strings, and
incremental text that never sends half a character or the start of a stop string."""
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

    def add(self, tokens: list[int]) -> None:
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

    def take_delta(self) -> tuple[list[int], str]:
        """What the client has not been sent yet, holding back text that may still change."""
        safe = len(self.text) if self.finish_reason else self._safe_length()
        tokens = self.token_ids[self._sent_tokens :]
        text = self.text[self._sent_chars : max(safe, self._sent_chars)]
        self._sent_tokens = len(self.token_ids)
        self._sent_chars += len(text)
        return tokens, text

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
