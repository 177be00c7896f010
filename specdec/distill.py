"""`specdec distill`: DistillSpec-style knowledge distillation of a drafter toward a verifier.

The student starts from some of the verifier's layers (or any causal LM with its tokenizer),
optionally shares its frozen embeddings and head, and may predict only a reduced draft
vocabulary. It trains on teacher samples, its own samples scored by the teacher (on-policy),
or both, under the chosen divergence. Evaluation on held-out prompts before and after
reports greedy agreement, sampling acceptance (1 - TVD at T=1) and accepted tokens per
verify call at depth 4. The output directory loads straight into drafter_service.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from tqdm import tqdm
from transformers import DynamicCache

from specdec.config import ConfigError, build_dataclass
from specdec.divergences import DIVERGENCES, divergence
from specdec.drafter_checkpoint import build_student, save_drafter, set_head
from specdec.models import BUILTIN_SMOLLM2, eos_token_ids, load_model_weights_only, load_tokenizer
from specdec.prompts import PACKAGED_PROMPTS, evaluation_split, load_prompts, training_split

DATA_MODES = ("teacher", "on-policy", "mixed")


@dataclass
class DistillConfig:
    verifier: str = BUILTIN_SMOLLM2
    init_layers: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    student_model: str | None = None  # start from this model instead of verifier layers
    share_embeddings: bool = True  # reuse the verifier's embeddings and head, frozen, not stored
    draft_vocab: int = 8192  # predict only the N most frequent teacher tokens; 0 = all
    data: str = "mixed"
    divergence: str = "fkl"
    jsd_beta: float = 0.5
    prompts: str = str(PACKAGED_PROMPTS)
    sample_tokens: int = 96  # length of each teacher / student sample
    max_prompt_tokens: int = 256  # longer prompts (long summarisation / RAG contexts) are left out
    teacher_samples_per_prompt: int = 2
    generation_batch: int = 16
    batch_size: int = 8
    steps: int = 300
    lr: float = 3e-4
    eval_prompts: int = 26
    eval_tokens: int = 64
    checkpoint_every: int = 20
    seed: int = 0
    out: str = "runs/drafter"
    dtype: str = "float16"  # how the student's weights are stored

    def __post_init__(self):
        if self.data not in DATA_MODES:
            raise ConfigError(f"data must be one of {', '.join(DATA_MODES)}, got '{self.data}'")
        if self.divergence not in DIVERGENCES:
            raise ConfigError(f"divergence must be one of {', '.join(DIVERGENCES)}, got '{self.divergence}'")
        if not 0 < self.jsd_beta < 1:
            raise ConfigError("jsd_beta must be in (0, 1)")
        if not self.init_layers and not self.student_model:
            raise ConfigError("give init_layers or student_model")
        for name in ("sample_tokens", "max_prompt_tokens", "batch_size", "steps", "eval_prompts", "eval_tokens", "checkpoint_every", "generation_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")


Sample = tuple[list[int], list[int]]  # (prompt ids, continuation ids)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False))


def _left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def sample_continuations(
    model, prompts: list[list[int]], max_new: int, eos: set[int], pad: int, generator: torch.Generator,
    greedy: bool = False, vocab_ids: torch.Tensor | None = None,
) -> list[list[int]]:
    """Batched sampling at T=1 (or greedy) with a KV cache. Works for students whose head
    covers only vocab_ids."""
    ids, mask = _left_pad(prompts, pad)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    steps = []
    for _ in range(max_new):
        logits = out.logits[:, -1].float()
        index = logits.argmax(-1) if greedy else torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
        tokens = index if vocab_ids is None else vocab_ids[index]
        steps.append(tokens)
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    generated = torch.stack(steps, dim=1).tolist()
    return [_cut_at_eos(g, eos) for g in generated]


def _generate_samples(model, tokenizer, prompts, per_prompt, cfg, eos, generator, desc, greedy=False, vocab_ids=None) -> list[Sample]:
    jobs = [p for p in prompts for _ in range(per_prompt)]
    samples: list[Sample] = []
    for start in tqdm(range(0, len(jobs), cfg.generation_batch), desc=desc, unit="batch"):
        batch = jobs[start : start + cfg.generation_batch]
        outs = sample_continuations(model, batch, cfg.sample_tokens if not greedy else cfg.eval_tokens, eos, tokenizer.pad_token_id or 0, generator, greedy, vocab_ids)
        samples += [(p, o) for p, o in zip(batch, outs) if o]
    return samples


def _batch_tensors(samples: list[Sample], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and the mask of positions whose next token is a
    continuation token (where a drafter drafts)."""
    seqs = [p + c for p, c in samples]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    loss_mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, (p, c) in enumerate(samples):
        loss_mask[row, len(p) - 1 : len(p) + len(c) - 1] = True
    return ids, mask, loss_mask


def _student_full_logp(student_logits: torch.Tensor, vocab_ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    logp = student_logits.float().log_softmax(-1)
    if vocab_ids is None:
        return logp
    full = torch.full((*logp.shape[:-1], vocab), float("-inf"))
    full[..., vocab_ids] = logp
    return full


@torch.inference_mode()
def evaluate(student, teacher, samples: list[Sample], pad: int, vocab_ids, depth: int = 4, batch: int = 8) -> dict:
    """Agreement, acceptance and accepted tokens per verify call along teacher greedy text."""
    agree, accept, positions = 0.0, 0.0, 0
    accepted_per_call: list[int] = []
    for start in range(0, len(samples), batch):
        chunk = samples[start : start + batch]
        ids, mask, loss_mask = _batch_tensors(chunk, pad)
        p_logp = teacher(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
        q_logp = _student_full_logp(student(input_ids=ids, attention_mask=mask).logits, vocab_ids, p_logp.shape[-1])
        matches = (p_logp.argmax(-1) == q_logp.argmax(-1)) & loss_mask
        agree += float(matches.sum())
        accept += float((torch.minimum(p_logp.exp(), q_logp.exp()).sum(-1) * loss_mask).sum())
        positions += int(loss_mask.sum())
        for row in range(len(chunk)):
            hits = matches[row][loss_mask[row]].tolist()
            t = 0
            while t < len(hits):  # greedy rounds: drafts are accepted while they match
                run = 0
                while run < depth and t + run < len(hits) and hits[t + run]:
                    run += 1
                accepted_per_call.append(run)
                t += run + 1
    return {
        "greedy_agreement": agree / positions,
        "sampling_acceptance_t1": accept / positions,
        f"accepted_per_verify_call_depth{depth}": sum(accepted_per_call) / len(accepted_per_call),
        "positions": positions,
    }


def _draft_vocab(samples: list[Sample], size: int, must_have: set[int]) -> list[int] | None:
    if size <= 0:
        return None
    counts = Counter(t for p, c in samples for t in p + c)
    chosen = set(must_have) | {t for t, _ in counts.most_common(size)}
    return sorted(chosen)[: max(size, len(must_have))] if len(chosen) > size else sorted(chosen)


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.rename(path)


def sample_settings(cfg: DistillConfig) -> dict:
    """What the cached teacher and evaluation samples depend on; another recipe with the same
    settings reuses them (copy samples.pt into its --out)."""
    keys = ("verifier", "prompts", "sample_tokens", "max_prompt_tokens", "teacher_samples_per_prompt", "eval_prompts", "eval_tokens", "seed")
    return {k: getattr(cfg, k) for k in keys}


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
    short = [r for r in rows if len(chat_ids(tokenizer, r["prompt"])) <= cfg.max_prompt_tokens]
    train_rows, eval_rows = training_split(short), evaluation_split(short, cfg.eval_prompts)
    # Similar lengths batch together, so left padding wastes little.
    train_prompts = sorted((chat_ids(tokenizer, r["prompt"]) for r in train_rows), key=len)
    eval_prompts = [chat_ids(tokenizer, r["prompt"]) for r in eval_rows]

    cached = out / "samples.pt"
    sample_key = sample_settings(cfg)
    data = torch.load(cached) if cached.is_file() else None
    if data is None or data.get("settings") != sample_key:
        data = {
            "settings": sample_key,
            "teacher": _generate_samples(teacher, tokenizer, train_prompts, cfg.teacher_samples_per_prompt, cfg, eos, generator, "teacher samples"),
            "eval": _generate_samples(teacher, tokenizer, eval_prompts, 1, cfg, eos, generator, "eval (teacher greedy)", greedy=True),
        }
        _atomic_save(data, cached)
    teacher_samples, eval_samples = data["teacher"], data["eval"]

    vocab_ids = _draft_vocab(teacher_samples, cfg.draft_vocab, eos)
    if cfg.student_model:
        student = load_model_weights_only(cfg.student_model, torch.float32)
        if load_tokenizer(cfg.student_model).get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"student_model {cfg.student_model} does not share the verifier's tokenizer")
        set_head(student, student.lm_head.weight.detach()[torch.tensor(vocab_ids)] if vocab_ids else student.lm_head.weight.detach(), vocab_ids)
        layers = list(range(student.config.num_hidden_layers))
    else:
        student = build_student(teacher, cfg.init_layers, vocab_ids)
        layers = cfg.init_layers
    shared = cfg.share_embeddings and not cfg.student_model
    if shared:
        student.model.embed_tokens.weight.requires_grad_(False)
        student.lm_head.weight.requires_grad_(False)
    vocab_tensor = None if vocab_ids is None else torch.tensor(vocab_ids)
    trainable = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / cfg.steps))

    checkpoint_path = out / "checkpoint.pt"
    step, history, before = 0, [], None
    if checkpoint_path.is_file():
        state = torch.load(checkpoint_path, weights_only=False)
        if state["config"] != dataclasses.asdict(cfg):
            raise ConfigError(f"{checkpoint_path} was made with another recipe; use a new --out or delete it")
        student.load_state_dict(state["student"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, history, before = state["step"], state["history"], state["before"]
        random.setstate(state["python_rng"])
        generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        print(f"resuming from step {step}")
    student.eval()
    if before is None:
        before = evaluate(student, teacher, eval_samples, pad, vocab_tensor)
        print("before:", json.dumps(before))

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
        ids, mask, loss_mask = _batch_tensors(batch, pad)
        with torch.no_grad():
            teacher_logits = teacher(input_ids=ids, attention_mask=mask).logits
            if vocab_tensor is not None:
                teacher_logits = teacher_logits[..., vocab_tensor]
            teacher_logp = teacher_logits.float().log_softmax(-1)[loss_mask]
        student.train()
        student_logp = student(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)[loss_mask]
        loss = divergence(cfg.divergence, teacher_logp, student_logp, cfg.jsd_beta).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        step += 1
        with torch.no_grad():
            live_accept = float(torch.minimum(teacher_logp.exp(), student_logp.exp()).sum(-1).mean())
        history.append({"step": step, "loss": loss.item(), "acceptance": live_accept})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", accept=f"{live_accept:.3f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            _atomic_save(
                {
                    "config": dataclasses.asdict(cfg), "step": step, "history": history, "before": before,
                    "student": student.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                    "python_rng": random.getstate(), "generator": generator.get_state(), "torch_rng": torch.get_rng_state(),
                },
                checkpoint_path,
            )
    bar.close()
    student.eval()
    after = evaluate(student, teacher, eval_samples, pad, vocab_tensor)
    print("after:", json.dumps(after))
    recipe = dataclasses.asdict(cfg)
    save_drafter(out / "drafter", student, cfg.verifier, layers, shared, recipe, cfg.dtype)
    report = {
        "recipe": recipe,
        "train_question_ids": [r["question_id"] for r in train_rows],
        "eval_question_ids": [r["question_id"] for r in eval_rows],
        "teacher_samples": len(teacher_samples),
        "teacher_sample_tokens": sum(len(c) for _, c in teacher_samples),
        "draft_vocab_size": len(vocab_ids) if vocab_ids else None,
        "before": before,
        "after": after,
        "history": history,
        "seconds": time.time() - started,
        "drafter_dir": str(out / "drafter"),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'drafter'} and {out / 'report.json'}")
    return report


def add_distill_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML recipe (keys as the flags, with underscores); flags override it")
    for f in dataclasses.fields(DistillConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "init_layers":
            parser.add_argument(flag, help="comma-separated verifier layer indices the student starts from, e.g. 0,1,2,3")
        elif f.type in ("bool",):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            parser.add_argument(flag, type=kind, default=None)


def config_from_args(args) -> DistillConfig:
    data = {}
    if args.config:
        try:
            data = yaml.safe_load(Path(args.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"cannot read {args.config}: {err}") from None
    for f in dataclasses.fields(DistillConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            data[f.name] = [int(x) for x in value.split(",") if x.strip()] if f.name == "init_layers" else value
    return build_dataclass(DistillConfig, data, "")
