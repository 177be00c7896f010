"""Output bookkeeping: EOS, length, stop strings, stream deltas that never split a character
or leak the start of a stop string, and the text's spans by the source of its tokens."""
from __future__ import annotations

import random

from coordinator.output import OutputTracker
from tests.tiny_models import build_tokenizer

TOKENIZER = build_tokenizer()
EOS = 2


def ids(text: str) -> list[int]:
    return TOKENIZER(text)["input_ids"]


def test_eos_ends_with_the_eos_token_kept_and_later_tokens_dropped():
    out = OutputTracker(TOKENIZER, {EOS}, [], max_new_tokens=50)
    out.add(ids("w1 w2") + [EOS] + ids("w3 w4"))
    assert out.token_ids == ids("w1 w2") + [EOS]
    assert out.finish_reason == "stop"
    assert out.text == "w1 w2"


def test_length_limit_cuts_a_round_short():
    out = OutputTracker(TOKENIZER, {EOS}, [], max_new_tokens=3)
    out.add(ids("w1 w2 w3 w4 w5"))
    assert out.token_ids == ids("w1 w2 w3") and out.finish_reason == "length"


def test_stop_string_is_held_back_then_cut():
    out = OutputTracker(TOKENIZER, {EOS}, ["w5 w6"], max_new_tokens=50)
    out.add(ids("w1 w2 w5"))
    _, text, _ = out.take_delta()
    assert text == "w1 w2 "  # "w5" may begin the stop string: not sent yet
    out.add(ids("w7"))
    _, text, _ = out.take_delta()
    assert text == "w5 w7"  # it did not
    out.add(ids("w5 w6 w8"))
    assert out.finish_reason == "stop"
    tokens, text, _ = out.take_delta()
    assert out.text == "w1 w2 w5 w7 "
    assert text == " "
    assert tokens == ids("w5 w6")  # tokens up to the one that completed the stop string


def test_a_round_ends_where_token_by_token_adding_would():
    tokens = ids("w1 w2 w5 w6 w3 w5 w4") + [EOS] + ids("w7")
    for stop in ([], ["w5 w6"], ["w3 w5"], ["w4"], ["w9"]):
        for limit in (3, 8, 50):
            one_by_one = OutputTracker(TOKENIZER, {EOS}, stop, max_new_tokens=limit)
            for token in tokens:
                one_by_one.add([token])
            for split in (2, 3, len(tokens)):
                by_rounds = OutputTracker(TOKENIZER, {EOS}, stop, max_new_tokens=limit)
                for at in range(0, len(tokens), split):
                    by_rounds.add(tokens[at : at + split])
                assert (by_rounds.token_ids, by_rounds.text, by_rounds.finish_reason) == (
                    one_by_one.token_ids,
                    one_by_one.text,
                    one_by_one.finish_reason,
                ), (stop, limit, split)


def test_spans_mark_every_character_by_its_token_source_across_held_back_deltas():
    """Rounds of accepted drafts then the verifier's own token, cut by EOS, stop strings and
    the length limit: the spans of all deltas cover the text sent, each character marked as
    the token-by-token decoding says, each kept token counted once."""
    rng = random.Random(0)
    words = ids("w1 w2 w3 w5 w6 w7") + [EOS]
    for trial in range(200):
        stop = rng.choice([[], ["w5 w6"], ["w3"]])
        out = OutputTracker(TOKENIZER, {EOS}, stop, max_new_tokens=rng.choice([5, 40]))
        sources, spans, text = [], [], ""
        while not out.finish_reason and len(sources) < 40:
            round_tokens = [rng.choice(words) for _ in range(rng.randint(1, 5))]
            drafted = rng.randint(0, len(round_tokens) - 1)
            kept = out.add(round_tokens, drafted)
            sources += [i < drafted for i in range(kept)]
            _, delta, delta_spans = out.take_delta()
            text += delta
            spans += delta_spans
            assert sum(chars for chars, _, _ in delta_spans) == len(delta), trial
        out.end("length")
        _, delta, delta_spans = out.take_delta()
        text, spans = text + delta, spans + delta_spans
        assert text == out.text and sum(count for _, count, _ in spans) == len(out.token_ids), trial
        marked = [drafted for chars, _, drafted in spans for _ in range(chars)]
        expected, start = [], 0
        for n, drafted in enumerate(sources[: len(out.token_ids)], start=1):
            end = min(len(TOKENIZER.decode(out.token_ids[:n], skip_special_tokens=True)), len(out.text))
            expected += [drafted] * max(end - start, 0)
            start = max(start, end)
        assert marked == expected, trial
