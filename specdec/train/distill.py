"""`specdec distill`: DistillSpec-style knowledge distillation of a drafter toward a verifier.

The student starts from some of the verifier's layers (or any causal LM with its tokenizer),
optionally shares its frozen embeddings and head, and may predict only a reduced draft
vocabulary. It trains on teacher samples, its own samples scored by the teacher (on-policy),
or both, under the chosen divergence. Evaluation on held-out prompts before and after
reports greedy agreement, sampling acceptance (1 - TVD at T=1) and accepted tokens per
verify call at depth 4. The output directory loads straight into drafter_service.

With `steering`, the drafter also learns to read the verifier's SD² steering vector
(specdec/steering.py): the verifier-side projection and the drafter-side one train jointly
with the drafter (or alone, `steering_only`, over a frozen drafter), under forward KL on
verifier text, with drafter position t steered by verifier position t - o, o ~ U{1..k}.
"""
from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import field
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import Field, PositiveInt
from tqdm import tqdm

from specdec.core.drafter_checkpoint import (
    build_student,
    is_drafter_checkpoint,
    load_drafter,
    read_meta,
    save_drafter,
    set_head,
)
from specdec.core.hub import BUILTIN_SMOLLM2, load_model_weights_only, resolve_alias
from specdec.core.models import eos_token_ids, load_tokenizer
from specdec.core.prompts import (
    PACKAGED_PROMPTS,
    chat_ids,
    evaluation_split,
    load_prompts,
    training_split,
)
from specdec.core.steering import (
    DrafterSteering,
    VerifierSteering,
    default_layers,
    sample_offsets,
    save_steering,
)
from specdec.serving.config import ConfigError, settings
from specdec.train.agreement import SteeringPair, evaluate, steered
from specdec.train.divergences import DIVERGENCES, divergence
from specdec.train.files import Checkpoint, load_or_make, train_step, warmup_then_linear
from specdec.train.samples import Sample, batch_tensors, draft_vocab, generate_samples, sample_continuations

DATA_MODES = ("teacher", "on-policy", "mixed")


@settings
class DistillConfig:
    verifier: str = BUILTIN_SMOLLM2
    init_layers: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    # Start from this model instead of verifier layers: any causal LM with the verifier's
    # tokenizer, or a drafter checkpoint (which keeps its own layers and draft vocabulary).
    student_model: str | None = None
    share_embeddings: bool = True  # reuse the verifier's embeddings and head, frozen, not stored
    draft_vocab: int = 8192  # predict only the N most frequent teacher tokens; 0 = all
    data: Literal[DATA_MODES] = "mixed"
    divergence: Literal[DIVERGENCES] = "fkl"
    jsd_beta: Annotated[float, Field(gt=0, lt=1)] = 0.5
    prompts: str = str(PACKAGED_PROMPTS)
    exclude_categories: list[str] = field(default_factory=list)  # left out of training (an out-of-distribution check)
    sample_tokens: PositiveInt = 96  # length of each teacher / student sample
    max_prompt_tokens: PositiveInt = 256  # longer prompts (long summarisation / RAG contexts) are left out
    teacher_samples_per_prompt: int = 2
    generation_batch: PositiveInt = 16
    batch_size: PositiveInt = 8
    steps: PositiveInt = 300
    lr: float = 3e-4
    eval_prompts: PositiveInt = 26
    eval_tokens: PositiveInt = 64
    checkpoint_every: PositiveInt = 20
    seed: int = 0
    out: str = "runs/drafter"
    dtype: str = "float16"  # how the student's weights are stored
    steering: bool = False  # SD²: train the steering projections with the drafter
    steering_only: bool = False  # SD²: train only the projections, over a frozen drafter
    steering_layers: list[int] = field(default_factory=list)  # verifier layers read (empty = ~10%, 50%, 95%)
    steering_max_offset: PositiveInt = 4  # k: position t is steered from verifier position t - o, o ~ U{1..k}

    def __post_init__(self):
        if self.steering_only and not self.steering:
            raise ConfigError("steering_only needs steering: true")
        if self.steering_layers and len(self.steering_layers) != 3:
            raise ConfigError(f"steering_layers must name 3 verifier layers, got {self.steering_layers}")
        if not self.init_layers and not self.student_model:
            raise ConfigError("give init_layers or student_model")


def sample_settings(cfg: DistillConfig) -> dict:
    """What the cached teacher and evaluation samples depend on; another recipe with the same
    settings reuses them (copy samples.pt into its --out)."""
    keys = (
        "verifier", "prompts", "sample_tokens", "max_prompt_tokens", "teacher_samples_per_prompt", "eval_prompts", "eval_tokens", "seed"
    )
    return {k: getattr(cfg, k) for k in keys}


def _student(
    cfg: DistillConfig, teacher, teacher_samples: list[Sample], eos: set[int], tokenizer
) -> tuple[torch.nn.Module, list[int], list[int] | None, bool]:
    """(student, its layer indices in the verifier, its draft vocabulary, whether its
    embeddings and head are the verifier's, frozen and not stored)."""
    if cfg.student_model and is_drafter_checkpoint(resolve_alias(cfg.student_model)):
        student, _ = load_drafter(resolve_alias(cfg.student_model), torch.float32, scattered_head=False)
        meta = read_meta(resolve_alias(cfg.student_model))
        vocab = getattr(student, "draft_vocab_ids", None)
        return student, meta["layers"], None if vocab is None else vocab.tolist(), meta["shared_embeddings"]
    vocab_ids = draft_vocab(teacher_samples, cfg.draft_vocab, eos)
    if cfg.student_model:
        student = load_model_weights_only(cfg.student_model, torch.float32)
        if load_tokenizer(cfg.student_model).get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"student_model {cfg.student_model} does not share the verifier's tokenizer")
        set_head(
            student, student.lm_head.weight.detach()[torch.tensor(vocab_ids)] if vocab_ids else student.lm_head.weight.detach(), vocab_ids
        )
        return student, list(range(student.config.num_hidden_layers)), vocab_ids, False
    return build_student(teacher, cfg.init_layers, vocab_ids), cfg.init_layers, vocab_ids, cfg.share_embeddings


def run_distill(cfg: DistillConfig) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    started = time.time()

    tokenizer = load_tokenizer(cfg.verifier)
    teacher = load_model_weights_only(cfg.verifier, torch.float32).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    eos = set(eos_token_ids(teacher, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    rows = load_prompts(cfg.prompts)
    unknown = set(cfg.exclude_categories) - {r["category"] for r in rows}
    if unknown:
        raise ConfigError(f"exclude_categories: no such categories in {cfg.prompts}: {sorted(unknown)}")
    ids_of = {r["question_id"]: chat_ids(tokenizer, r["prompt"]) for r in rows}
    short = [r for r in rows if len(ids_of[r["question_id"]]) <= cfg.max_prompt_tokens]
    train_rows, eval_rows = training_split(short), evaluation_split(short, cfg.eval_prompts)
    # Similar lengths batch together, so left padding wastes little.
    train_prompts = sorted((ids_of[r["question_id"]] for r in train_rows), key=len)
    eval_prompts = [ids_of[r["question_id"]] for r in eval_rows]

    data = load_or_make(
        out / "samples.pt",
        sample_settings(cfg),
        lambda: {
            "teacher": generate_samples(
                teacher, tokenizer, train_prompts, cfg.teacher_samples_per_prompt, cfg, eos, generator, "teacher samples"
            ),
            "eval": generate_samples(teacher, tokenizer, eval_prompts, 1, cfg, eos, generator, "eval (teacher greedy)", greedy=True),
        },
    )
    # Excluded categories are dropped here, after the cache, so recipes that differ only in
    # them share one set of samples; their held-out prompts are evaluated apart.
    excluded = {tuple(ids_of[r["question_id"]]) for r in rows if r["category"] in cfg.exclude_categories}
    teacher_samples = [s for s in data["teacher"] if tuple(s[0]) not in excluded]
    eval_samples = [s for s in data["eval"] if tuple(s[0]) not in excluded]
    excluded_eval_samples = [s for s in data["eval"] if tuple(s[0]) in excluded]
    train_rows = [r for r in train_rows if r["category"] not in cfg.exclude_categories]

    student, layers, vocab_ids, shared = _student(cfg, teacher, teacher_samples, eos, tokenizer)
    if shared:
        student.model.embed_tokens.weight.requires_grad_(False)
        student.lm_head.weight.requires_grad_(False)
    if cfg.steering_only:
        student.requires_grad_(False)
    steering = None
    if cfg.steering:
        hidden = teacher.config.hidden_size
        steering = SteeringPair(
            VerifierSteering(hidden, cfg.steering_layers or default_layers(teacher.config.num_hidden_layers)),
            DrafterSteering.for_model(student, hidden),
            cfg.steering_max_offset,
        )
        steering.drafter.attach(student)
    vocab_tensor = None if vocab_ids is None else torch.tensor(vocab_ids)
    trainable = [p for p in student.parameters() if p.requires_grad] + (steering.parameters() if steering else [])
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    schedule = warmup_then_linear(optimizer, cfg.steps, floor=0.1)

    def evaluations(steered: bool) -> tuple[dict, dict | None]:
        """On the held-out prompts, and apart on those of the excluded categories."""
        use = steering if steered else None
        outside = evaluate(student, teacher, excluded_eval_samples, pad, vocab_tensor, use) if excluded_eval_samples else None
        return evaluate(student, teacher, eval_samples, pad, vocab_tensor, use), outside

    checkpoint = Checkpoint(out, dataclasses.asdict(cfg), optimizer, schedule, generator)
    step, history, before = 0, [], None
    if (state := checkpoint.resume()) is not None:
        student.load_state_dict(state["student"])
        if steering:
            steering.verifier.load_state_dict(state["steering"]["verifier"])
            steering.drafter.load_state_dict(state["steering"]["drafter"])
        step, history, before = state["step"], state["history"], state["before"]
    student.eval()
    if before is None:
        before = evaluations(steered=False)  # an untrained steering is exactly no steering
        print("before:", json.dumps(before[0]))

    on_policy_share = {"teacher": 0.0, "on-policy": 1.0, "mixed": 0.5}[cfg.data]
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step")
    while step < cfg.steps:
        prompts_or_samples = random.sample(range(len(teacher_samples)), cfg.batch_size)
        if random.random() < on_policy_share:
            student.eval()
            prompts = [teacher_samples[i][0] for i in prompts_or_samples]
            conts = sample_continuations(student, prompts, cfg.sample_tokens, eos, pad, generator, vocab_ids=vocab_tensor)
            batch = [(p, c) for p, c in zip(prompts, conts) if c]
        else:
            batch = [teacher_samples[i] for i in prompts_or_samples]
        ids, mask, loss_mask = batch_tensors(batch, pad)
        with torch.no_grad():
            teacher_out = teacher(input_ids=ids, attention_mask=mask, output_hidden_states=steering is not None)
            teacher_logits = teacher_out.logits
            if vocab_tensor is not None:
                teacher_logits = teacher_logits[..., vocab_tensor]
            teacher_logp = teacher_logits.float().log_softmax(-1)[loss_mask]
        student.train()
        offsets = sample_offsets(mask.bool(), cfg.steering_max_offset, generator) if steering else None
        with steered(steering, teacher_out.hidden_states, mask, offsets):
            student_logp = student(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)[loss_mask]
        loss = divergence(cfg.divergence, teacher_logp, student_logp, cfg.jsd_beta).mean()
        train_step(loss, trainable, optimizer, schedule)
        step += 1
        with torch.no_grad():
            live_accept = float(torch.minimum(teacher_logp.exp(), student_logp.exp()).sum(-1).mean())
        history.append({"step": step, "loss": loss.item(), "acceptance": live_accept})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", accept=f"{live_accept:.3f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            checkpoint.save(
                step=step, history=history, before=before, student=student.state_dict(),
                steering={"verifier": steering.verifier.state_dict(), "drafter": steering.drafter.state_dict()} if steering else None,
            )
    bar.close()
    student.eval()
    after = evaluations(steered=steering is not None)
    print("after:", json.dumps(after[0]))
    recipe = dataclasses.asdict(cfg)
    save_drafter(out / "drafter", student, cfg.verifier, layers, shared, recipe, cfg.dtype)
    report = {
        "recipe": recipe,
        "train_question_ids": [r["question_id"] for r in train_rows],
        "eval_question_ids": [r["question_id"] for r in eval_rows if r["category"] not in cfg.exclude_categories],
        "excluded_eval_question_ids": [r["question_id"] for r in eval_rows if r["category"] in cfg.exclude_categories],
        "teacher_samples": len(teacher_samples),
        "teacher_sample_tokens": sum(len(c) for _, c in teacher_samples),
        "draft_vocab_size": len(vocab_ids) if vocab_ids else None,
        "before": before[0],
        "after": after[0],
        "history": history,
        "seconds": time.time() - started,
        "drafter_dir": str(out / "drafter"),
    }
    if steering:
        save_steering(out / "drafter", cfg.verifier, steering.verifier, steering.drafter, cfg.steering_max_offset, cfg.dtype)
        unsteered = evaluations(steered=False)
        report["after_unsteered"] = unsteered[0]
        print("after, unsteered:", json.dumps(unsteered[0]))
    if excluded_eval_samples:
        report["excluded_categories"] = {"names": cfg.exclude_categories, "before": before[1], "after": after[1]}
        if steering:
            report["excluded_categories"]["after_unsteered"] = unsteered[1]
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'drafter'} and {out / 'report.json'}")
    return report


LIST_HELP = {
    "init_layers": "comma-separated verifier layer indices the student starts from, e.g. 0,1,2,3",
    "exclude_categories": "comma-separated prompt categories left out of training, e.g. translation",
    "steering_layers": "comma-separated verifier layers the steering reads (3; default ~10%%, 50%%, 95%% of depth)",
}
