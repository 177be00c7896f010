"""Frequency-ranked draft vocabularies: the ranking, a head cut to it (its rows, -inf elsewhere,
in every weight format), the configs that may ask for one, and served greedy output that stays
the verifier's own."""
from __future__ import annotations

import pytest
import torch

from specdec.core.draft_vocab import draft_vocab_ids, token_ranking
from specdec.core.hub import BUILTIN_SMOLLM2
from specdec.core.models import ModelSpec, hf_greedy, load_model, load_tokenizer, tokenizer_fingerprint
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.config import ConfigError, config_from_dict
from tests.conftest import local_stack, tiny_config


def test_the_ranking_puts_code_tokens_first_and_keeps_every_special_token():
    tokenizer = load_tokenizer(BUILTIN_SMOLLM2)
    fingerprint = tokenizer_fingerprint(tokenizer)
    ranking = token_ranking(tokenizer, fingerprint)
    assert sorted(ranking) == list(range(len(tokenizer)))
    top = {tokenizer.decode([t]) for t in ranking[:64]}
    assert {"(", ")", ":", "\n", " self", " def", " the"} <= top
    ids = draft_vocab_ids(tokenizer, 4096, fingerprint)
    assert ids == sorted(ids) and set(ranking[:4096]) <= set(ids)
    assert set(tokenizer.all_special_ids) <= set(ids) and len(ids) < 4096 + len(tokenizer.get_added_vocab()) + 1
    with pytest.raises(ValueError, match="draft_vocab: 49152 is not between 1 and 49151"):
        draft_vocab_ids(tokenizer, len(tokenizer), fingerprint)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_cut_head_gives_its_rows_logits_and_minus_inf_elsewhere(tiny_dirs, dtype):
    whole = load_model(ModelSpec(str(tiny_dirs["drafter"]), dtype=dtype))
    cut = load_model(ModelSpec(str(tiny_dirs["drafter"]), dtype=dtype, draft_vocab=6))
    ids = cut.draft_vocab_ids
    assert ids.tolist() == [0, 1, 2, 3, 4, 5]  # the tiny words are all unknown in the corpus: <unk> first, then by id
    inputs = torch.tensor([[3, 7, 9, 4, 12]])
    with torch.inference_mode():
        expected, logits = whole(inputs).logits[0], cut(inputs).logits[0]
    outside = torch.ones(logits.shape[-1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(logits[:, outside]).all() and (logits[:, outside] < 0).all()
    if dtype == "int8":  # the same rows, quantized alike, after the same calibration
        assert torch.equal(logits[:, ids], expected[:, ids])
    else:
        torch.testing.assert_close(logits[:, ids], expected[:, ids])


def test_only_a_drafter_model_takes_a_draft_vocabulary():
    with pytest.raises(ConfigError, match="verifier.model.draft_vocab: the verifier decides over the whole vocabulary"):
        config_from_dict({"verifier": {"model": {"source": BUILTIN_SMOLLM2, "draft_vocab": 1024}}})
    with pytest.raises(ConfigError, match=r"drafter.model.draft_vocab must be >= 0 \(0 = the whole vocabulary\)"):
        config_from_dict({"drafter": {"model": {"source": BUILTIN_SMOLLM2, "draft_vocab": -1}}})
    with pytest.raises(ConfigError, match="drafter.model.draft_vocab cuts a drafter model's head"):
        config_from_dict({"drafter": {"model": {"source": "suffix", "draft_vocab": 1024}}})
    assert config_from_dict({"drafter": {"model": {"source": BUILTIN_SMOLLM2, "draft_vocab": 1024}}}).drafter.model.draft_vocab == 1024


def test_greedy_with_a_draft_vocabulary_is_the_verifiers_own(tiny_dirs, tiny_verifier):
    config = tiny_config(tiny_dirs)
    config["drafter"]["model"] = {"source": str(tiny_dirs["near_verifier"]), "dtype": "int8", "draft_vocab": 6}
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        for prompt in ("w4 w4 w9", "w1 w2 w3 w5"):
            reply = client.generate(generate_request(prompt, max_new_tokens=24, num_draft_tokens=3))
            ids = stack["coordinator_obj"].tokenizer(prompt)["input_ids"]
            assert list(reply.token_ids) == hf_greedy(tiny_verifier, ids, 24)
            assert reply.stats.drafted_tokens > 0
        client.close()
