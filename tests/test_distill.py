"""DistillSpec distillation: divergences against hand-computed values, a short real run on
tiny models that measurably aligns the student, resume after a kill, and the distilled
(reduced-vocabulary) checkpoint served by drafter_service with exact output."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdec.core.models import ModelSpec, hf_greedy, load_model
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.config import ConfigError, parse
from specdec.train.distill import DistillConfig, run_distill
from specdec.train.divergences import divergence
from tests.conftest import local_stack
from tests.test_services import sampled_first_two_tokens

P = torch.tensor([0.5, 0.25, 0.25])
Q = torch.tensor([0.25, 0.25, 0.5])


@pytest.mark.parametrize(
    "name,expected",
    [
        ("fkl", 0.5 * math.log(2) + 0.25 * math.log(0.5)),  # Σ p log p/q = 0.25 ln 2
        ("rkl", 0.25 * math.log(0.5) + 0.5 * math.log(2)),
        ("tvd", 0.25),
        # m = (p+q)/2 = [0.375, 0.25, 0.375]
        (
            "jsd",
            0.5 * (0.5 * math.log(0.5 / 0.375) + 0.25 * math.log(0.25 / 0.375))
            + 0.5 * (0.25 * math.log(0.25 / 0.375) + 0.5 * math.log(0.5 / 0.375)),
        ),
    ],
)
def test_divergences_against_hand_computed_values(name, expected):
    assert float(divergence(name, P.log(), Q.log())) == pytest.approx(expected, abs=1e-6)


def test_jsd_beta_and_zero_probabilities():
    p, q = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5])
    # β = 0.9: m = [0.95, 0.05]; 0.9 KL(p||m) + 0.1 KL(q||m)
    expected = 0.9 * math.log(1 / 0.95) + 0.1 * (0.5 * math.log(0.5 / 0.95) + 0.5 * math.log(0.5 / 0.05))
    assert float(divergence("jsd", p.log(), q.log(), beta=0.9)) == pytest.approx(expected, abs=1e-6)
    assert float(divergence("fkl", p.log(), q.log())) == pytest.approx(math.log(2), abs=1e-6)
    assert float(divergence("tvd", p.log(), p.log())) == 0.0
    with pytest.raises(ValueError, match="unknown divergence"):
        divergence("kl", P.log(), Q.log())


def test_recipe_validation():
    with pytest.raises(ConfigError, match="divergence"):
        parse(DistillConfig, {"divergence": "l2"})
    with pytest.raises(ConfigError, match="data"):
        parse(DistillConfig, {"data": "web"})
    with pytest.raises(ConfigError, match="unknown key stepz"):
        parse(DistillConfig, {"stepz": 3})


@pytest.fixture(scope="module")
def tiny_prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    gen = torch.Generator().manual_seed(0)
    rows = []
    for qid in range(48):
        words = " ".join(f"w{int(i)}" for i in torch.randint(0, 13, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen))
        rows.append({"question_id": qid, "category": ["a", "b"][qid % 2], "turns": [words]})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def tiny_recipe(tiny_dirs, tiny_prompts, out: Path, **overrides) -> DistillConfig:
    base = dict(
        verifier=str(tiny_dirs["verifier"]), init_layers=[0], prompts=str(tiny_prompts), sample_tokens=12,
        teacher_samples_per_prompt=2, generation_batch=16, batch_size=8, steps=60, lr=3e-3, eval_prompts=12,
        eval_tokens=12, checkpoint_every=20, draft_vocab=10, out=str(out), dtype="float32",
    )
    base.update(overrides)
    return parse(DistillConfig, base)


@pytest.fixture(scope="module")
def distilled(tiny_dirs, tiny_prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill")
    return run_distill(tiny_recipe(tiny_dirs, tiny_prompts, out))


def test_short_distillation_aligns_the_student(distilled):
    before, after = distilled["before"], distilled["after"]
    assert after["greedy_agreement"] > before["greedy_agreement"] + 0.05
    assert after["sampling_acceptance_t1"] > before["sampling_acceptance_t1"] + 0.05
    assert after["accepted_per_verify_call_depth4"] > before["accepted_per_verify_call_depth4"]
    losses = [h["loss"] for h in distilled["history"]]
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10
    assert set(distilled["train_question_ids"]).isdisjoint(distilled["eval_question_ids"])
    assert distilled["draft_vocab_size"] == 10


def test_checkpoint_directory_is_small_and_self_describing(distilled):
    drafter = Path(distilled["drafter_dir"])
    meta = json.loads((drafter / "specdec_drafter.json").read_text())
    assert meta["shared_embeddings"] and meta["layers"] == [0] and meta["recipe"]["divergence"] == "fkl"
    assert len(json.loads((drafter / "draft_vocab.json").read_text())) == 10
    from safetensors.torch import load_file

    stored = load_file(drafter / "model.safetensors")
    assert not any(k.startswith(("model.embed_tokens", "lm_head")) for k in stored)  # shared, not stored twice


def test_reduced_vocabulary_drafter_is_exact_in_the_services(distilled, tiny_dirs):
    config = {
        "verifier": {"model": str(tiny_dirs["verifier"]), "torch_threads": 1},
        "drafter": {"model": distilled["drafter_dir"], "torch_threads": 1},
        "coordinator": {"num_draft_tokens": 3, "adaptive": {"enabled": False}},
    }
    verifier = load_model(ModelSpec(str(tiny_dirs["verifier"])))
    with local_stack(config) as stack:
        assert (
            stack["coordinator_obj"].pair.drafter_info.tokenizer_fingerprint
            == stack["coordinator_obj"].pair.verifier_info.tokenizer_fingerprint
        )
        client = CoordinatorClient(stack["coordinator"])
        accepted = 0
        for prompt in ([1, 4, 5], [1, 9], [3, 3, 8, 12]):
            reply = client.generate(generate_request(prompt_token_ids=prompt, max_new_tokens=30))
            assert list(reply.token_ids) == hf_greedy(verifier, prompt, 30)
            accepted += reply.stats.accepted_draft_tokens
        assert accepted > 0
        client.close()
        sampled_first_two_tokens(stack, verifier, draws=2000)


def test_distilled_drafter_works_as_a_hugging_face_assistant(distilled, tiny_dirs):
    """The reduced-vocabulary head answers in full-vocabulary logits, so transformers'
    assisted generation (the benchmark's baseline) takes the same checkpoint."""
    verifier = load_model(ModelSpec(str(tiny_dirs["verifier"])))
    drafter = load_model(ModelSpec(distilled["drafter_dir"]))
    prompt = torch.tensor([[1, 4, 5]])
    logits = drafter(prompt).logits[0, -1]
    assert logits.shape[-1] == 16 and torch.isinf(logits).sum() == 16 - 10
    with torch.inference_mode():
        assisted = verifier.generate(prompt, assistant_model=drafter, max_new_tokens=20, do_sample=False)
    assert assisted[0, 3:].tolist() == hf_greedy(verifier, [1, 4, 5], 20)


def assert_resumes_after_kill(command: str, recipe, tmp_path: Path, steps: int, flags: list[str] = ()) -> None:
    """Runs `specdec COMMAND --config` on `recipe` (a dataclass whose `out` is under tmp_path),
    kills it once it has checkpointed, runs it again (with `flags`) and checks it resumed and
    finished all `steps`."""
    import yaml

    out = Path(recipe.out)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(dict(recipe.__dict__)))
    argv = [sys.executable, "-m", "specdec.cli", command, "--config", str(path)]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600  # a hang guard: it is killed as soon as the checkpoint is there
    while not (out / "checkpoint.pt").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    first.kill()
    first.wait()
    assert (out / "checkpoint.pt").exists(), first.stdout.read()
    second = subprocess.run(argv + list(flags), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from step" in second.stdout
    report = json.loads((out / "report.json").read_text())
    assert len(report["history"]) == steps and report["history"][-1]["step"] == steps


@pytest.mark.slow  # 35 s; the same resume path runs in CI for the feature head (test_training_resumes_after_a_kill)
def test_distillation_resumes_after_a_kill(tiny_dirs, tiny_prompts, tmp_path):
    cfg = tiny_recipe(tiny_dirs, tiny_prompts, tmp_path / "run", steps=400, checkpoint_every=5)
    assert_resumes_after_kill("distill", cfg, tmp_path, 400, ["--steps", "400"])
