"""`specdec distill-feature-head`: train the verifier-feature drafter (specdec/core/feature_head.py).

Data: the served verifier (its own engine and weight format, so the features are the ones it
will send) continues each training prompt, greedy once and sampled at T=1 after that; every
position's residual stream at the three fused depths and the verifier's next-token
distribution on the draft vocabulary (its top `target_top_k`) are cached. With `prompt_text`,
the verifier also reads every training prompt whole (long ones included) in one teacher-forced
pass, cut into chunks of `text_chunk_tokens`: three times more positions for a fraction of the
cost of generating them, which a head this size needs not to memorise its few samples.
With `self_instruct_prompts`, the verifier also writes prompts of its own (Magpie: it samples
the user turn of its chat template from nothing) and answers them: data on its own
distribution beyond the training split.

On a GPU (`device: cuda`) the verifier runs in float32 through transformers' forward, many
sequences at a time: continuations come from batched `generate()`, then one teacher-forced pass
per batch reads the depths and targets. The served int8 CPU engine is not there; its features
differ from float32 ones by its quantization only, and the head is evaluated on them afterwards.

The head is trained unrolled, as a live draft runs it, and evaluated on held-out prompts before
and after: specdec/train/unroll.py.
"""
from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import field
from pathlib import Path

import torch
from pydantic import NonNegativeInt, PositiveInt
from tqdm import tqdm
from transformers import GenerationConfig

from specdec.core.engine import engine_for
from specdec.core.feature_head import FeatureHead, save_feature_head
from specdec.core.hub import (
    BUILTIN_DRAFTER,
    BUILTIN_SMOLLM2,
    load_model_weights_only,
    resolve_alias,
)
from specdec.core.models import ModelSpec, eos_token_ids, load_model, load_tokenizer
from specdec.core.prompts import (
    PACKAGED_PROMPTS,
    chat_ids,
    evaluation_split,
    load_prompts,
    training_split,
)
from specdec.core.steering import default_layers
from specdec.serving.config import ConfigError, settings
from specdec.train.files import Checkpoint, atomic_save, load_or_make, train_step, warmup_then_linear
from specdec.train.unroll import Sample, evaluate, unrolled_loss


@settings
class FeatureHeadConfig:
    verifier: str = BUILTIN_SMOLLM2
    verifier_dtype: str = "int8"  # the weight format the verifier is served in: its features are what the head reads
    draft_vocab_from: str = BUILTIN_DRAFTER  # a directory with draft_vocab.json
    layers: list[int] = field(default_factory=list)  # verifier depths fused (empty = ~10%, 50%, 95%)
    prompts: str = str(PACKAGED_PROMPTS)
    max_prompt_tokens: PositiveInt = 256
    sample_tokens: PositiveInt = 96
    samples_per_prompt: PositiveInt = 2  # the first greedy, the others sampled at T=1
    prompt_text: bool = True  # also the training prompts themselves, teacher-forced
    text_chunk_tokens: PositiveInt = 256
    weight_decay: float = 0.01
    target_top_k: PositiveInt = 32
    unroll: PositiveInt = 4
    batch_size: PositiveInt = 4
    steps: PositiveInt = 400
    lr: float = 1e-3
    eval_prompts: PositiveInt = 26
    eval_tokens: PositiveInt = 64
    checkpoint_every: PositiveInt = 20
    seed: int = 0
    dtype: str = "float16"
    out: str = "runs/feature_head"
    device: str = "cpu"  # "cuda": batched float32 samples and training on the GPU
    self_instruct_prompts: NonNegativeInt = 0  # prompts the verifier writes itself (Magpie), answered like the others
    generation_batch: PositiveInt = 256  # sequences generated at once (device: cuda)

    def __post_init__(self):
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"device must be cpu or cuda[:N], got '{self.device}'")
        if self.layers and len(self.layers) != 3:
            raise ConfigError(f"layers must name 3 verifier depths, got {self.layers}")


@torch.inference_mode()
def _continue(
    engine, prompt: list[int], max_new: int, layers: list[int], vocab_ids: torch.Tensor, top_k: int, eos: set[int],
    generator: torch.Generator | None,
) -> Sample | None:
    """Runs the verifier's engine along prompt + its own continuation (greedy when generator is
    None), keeping the three depths at every position it reads and its targets."""
    cache, tokens, hidden, ids, probs = engine.new_cache(), list(prompt), [], [], []
    pending = list(prompt)
    for _ in range(max_new):
        logits, states = engine(cache, pending, 1, hidden_states=True)
        hidden.append(torch.stack([states[i][0] for i in layers], dim=1).half())
        full = torch.softmax(logits[-1].double(), -1)
        top = torch.topk(full[vocab_ids], top_k)
        ids.append(top.indices.short())
        probs.append(top.values.half())
        token = int(full.argmax()) if generator is None else int(torch.multinomial(full, 1, generator=generator))
        tokens.append(token)
        if token in eos:
            break
        pending = [token]
    if len(tokens) - len(prompt) < 2:
        return None
    return Sample(torch.tensor(tokens), len(prompt), torch.cat(hidden), torch.stack(ids), torch.stack(probs))


@torch.inference_mode()
def _read_text(engine, ids: list[int], chunk: int, layers: list[int], vocab_ids: torch.Tensor, top_k: int) -> list[Sample]:
    """The verifier reads `ids` in one teacher-forced pass (chunk by chunk over one cache, so
    every feature has the whole text before it); each chunk becomes a sample whose every
    position but the last is trained on."""
    cache, samples = engine.new_cache(), []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        logits, states = engine(cache, piece, len(piece), hidden_states=True)
        if len(piece) < 3:
            break
        top = torch.topk(torch.softmax(logits[:-1].double(), -1)[:, vocab_ids], top_k)
        hidden = torch.stack([states[i][0, :-1] for i in layers], dim=1).half()
        samples.append(Sample(torch.tensor(piece), 1, hidden, top.indices.short(), top.values.half()))
    return samples


@torch.inference_mode()
def _generate(
    model, prompts: list[list[int]], max_new: int, eos: list[int], sample: bool, batch: int, desc: str
) -> list[tuple[list[int], list[int]]]:
    """(prompt, continuation up to and with its end token) for every prompt, `batch` at a time,
    left-padded (generate() derives positions from the attention mask)."""
    device = model.device
    config = GenerationConfig(
        max_new_tokens=max_new, do_sample=sample, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=eos[0]
    )
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # little padding
    results: list = [None] * len(prompts)
    for start in tqdm(range(0, len(order), batch), desc=desc, unit="batch"):
        chosen = order[start : start + batch]
        width = max(len(prompts[i]) for i in chosen)
        ids = torch.full((len(chosen), width), eos[0], dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(chosen):
            ids[row, width - len(prompts[i]) :], mask[row, width - len(prompts[i]) :] = torch.tensor(prompts[i]), 1
        new = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)[:, width:].tolist()
        for i, tokens in zip(chosen, new):
            end = next((j + 1 for j, t in enumerate(tokens) if t in eos), len(tokens))
            results[i] = (prompts[i], tokens[:end])
    return results


@torch.inference_mode()
def _teacher_pass(
    model, sequences: list[tuple[list[int], list[int]]], layers: list[int], vocab_ids: torch.Tensor, top_k: int, batch_tokens: int = 32768
) -> list[Sample]:
    """Every (prompt, continuation) read back in one teacher-forced pass: right-padded, so no
    real token ever sees a pad under the causal mask. Samples live on the CPU."""
    samples = []
    length = [len(p) + len(c) for p, c in sequences]
    order = sorted(range(len(sequences)), key=length.__getitem__)  # a batch is as wide as its last
    vocab_ids = vocab_ids.to(model.device)
    start = 0
    with tqdm(total=len(order), desc="verifier reads the samples", unit="sample") as bar:
        while start < len(order):
            end = start + 1
            while end < len(order) and (end - start + 1) * length[order[end]] <= batch_tokens:
                end += 1
            chosen = [sequences[i] for i in order[start:end]]
            width = length[order[end - 1]]
            ids = torch.zeros(len(chosen), width, dtype=torch.long)
            for row, (p, c) in enumerate(chosen):
                ids[row, : len(p) + len(c)] = torch.tensor(p + c)
            out = model(input_ids=ids.to(model.device), output_hidden_states=True)
            depths = torch.stack([out.hidden_states[i] for i in layers], dim=2)
            for row, (p, c) in enumerate(chosen):
                n = len(p) + len(c)
                probs = torch.softmax(out.logits[row, len(p) - 1 : n - 1].float(), -1)[:, vocab_ids]
                top = torch.topk(probs, top_k)
                samples.append(
                    Sample(
                        ids[row, :n].clone(), len(p), depths[row, : n - 1].half().cpu(), top.indices.short().cpu(), top.values.half().cpu()
                    )
                )
            bar.update(end - start)
            start = end
    return samples


def _self_instruct(model, tokenizer, count: int, eos: list[int], batch: int) -> list[list[int]]:
    """`count` prompts the verifier writes itself (Magpie): its chat template up to the user's
    words, then its own sample at T=1 until an end token (replaced by the template's own
    closing and the assistant's turn); kept when the turn ends in time."""
    marker = "\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False)
    before, after = text.split(marker)
    opening = tokenizer(before, add_special_tokens=False)["input_ids"]
    closing = tokenizer(after, add_special_tokens=False)["input_ids"]
    asked = _generate(model, [opening] * count, 96, eos, True, batch, "verifier writes prompts")
    return [opening + words[:-1] + closing for _, words in asked if len(words) > 3 and words[-1] in eos]


def _collect_batched(cfg: FeatureHeadConfig, verifier: _ServedVerifier, layers: list[int], vocab_ids: torch.Tensor) -> dict:
    tokenizer = load_tokenizer(cfg.verifier)
    model, _ = verifier.get()
    eos = eos_token_ids(model, tokenizer)
    ids_of, train_rows, eval_rows = _training_rows(cfg, tokenizer)
    torch.manual_seed(cfg.seed)
    prompts = [ids_of[r["question_id"]] for r in train_rows]
    prompts += _self_instruct(model, tokenizer, cfg.self_instruct_prompts, eos, cfg.generation_batch)
    many = [p for p in prompts for _ in range(cfg.samples_per_prompt - 1)]
    runs = _generate(model, prompts, cfg.sample_tokens, eos, False, cfg.generation_batch, "verifier greedy (train)")
    runs += _generate(model, many, cfg.sample_tokens, eos, True, cfg.generation_batch, "verifier samples (train)")
    train = _teacher_pass(model, [r for r in runs if len(r[1]) >= 2], layers, vocab_ids, cfg.target_top_k)
    held_out = _generate(
        model, [ids_of[r["question_id"]] for r in eval_rows], cfg.eval_tokens, eos, False, cfg.generation_batch,
        "verifier greedy (held out)",
    )
    evaluation = _teacher_pass(model, [r for r in held_out if len(r[1]) >= 2], layers, vocab_ids, cfg.target_top_k)
    return {
        "train": train,
        "eval": evaluation,
        "train_question_ids": [r["question_id"] for r in train_rows],
        "eval_question_ids": [r["question_id"] for r in eval_rows],
        "self_instruct_prompts": len(prompts) - len(train_rows),
    }


def _text_chunks(sample: Sample, size: int) -> list[Sample]:
    """A text read whole, as samples of `size` tokens (each trained on all but its last)."""
    pieces = []
    for start in range(0, len(sample.tokens) - 2, size):
        end = min(start + size, len(sample.tokens))
        pieces.append(Sample(
            sample.tokens[start:end], 1, sample.hidden[start : end - 1], sample.target_ids[start : end - 1],
            sample.target_probs[start : end - 1],
        ))
    return pieces


class _ServedVerifier:
    """The verifier as it is served, loaded (and int8-calibrated) on first use only: a run whose
    samples are all cached never loads it, one that makes both kinds of samples loads it once.
    On a GPU it is the float32 model there, with no engine (batched passes use its forward)."""

    def __init__(self, cfg: FeatureHeadConfig):
        self.cfg = cfg
        self._loaded = None

    def get(self):
        """(model, engine or None)."""
        if self._loaded is None:
            if self.cfg.device != "cpu":
                model = load_model_weights_only(self.cfg.verifier, torch.float32).to(self.cfg.device).eval()
                self._loaded = model, None
            else:
                model = load_model(ModelSpec(self.cfg.verifier, dtype=self.cfg.verifier_dtype))
                self._loaded = model, engine_for(model, self.cfg.verifier_dtype)
        return self._loaded


def _training_rows(cfg: FeatureHeadConfig, tokenizer) -> tuple[dict, list[dict], list[dict]]:
    rows = load_prompts(cfg.prompts)
    ids_of = {r["question_id"]: chat_ids(tokenizer, r["prompt"]) for r in rows}
    short = [r for r in rows if len(ids_of[r["question_id"]]) <= cfg.max_prompt_tokens]
    return ids_of, training_split(short), evaluation_split(short, cfg.eval_prompts)


def _collect_text(cfg: FeatureHeadConfig, verifier: _ServedVerifier, layers: list[int], vocab_ids: torch.Tensor) -> list[Sample]:
    tokenizer = load_tokenizer(cfg.verifier)
    model, engine = verifier.get()
    rows = training_split(load_prompts(cfg.prompts))
    if engine is None:  # GPU: whole prompts in batched passes, then cut like _read_text cuts
        texts = [(ids[:1], ids[1:]) for ids in (chat_ids(tokenizer, r["prompt"]) for r in rows) if len(ids) >= 3]
        whole = _teacher_pass(model, texts, layers, vocab_ids, cfg.target_top_k)
        return [piece for sample in whole for piece in _text_chunks(sample, cfg.text_chunk_tokens)]
    samples = []
    for r in tqdm(rows, desc="verifier reads the training prompts", unit="prompt"):
        samples += _read_text(engine, chat_ids(tokenizer, r["prompt"]), cfg.text_chunk_tokens, layers, vocab_ids, cfg.target_top_k)
    return samples


def _collect(
    cfg: FeatureHeadConfig, verifier: _ServedVerifier, layers: list[int], vocab_ids: torch.Tensor, partial_path: Path, settings: dict
) -> dict:
    """Generation takes hours for large recipes: its progress is saved every 10 prompts to
    `partial_path` and picked up again after a kill."""
    if cfg.device != "cpu":
        return _collect_batched(cfg, verifier, layers, vocab_ids)
    tokenizer = load_tokenizer(cfg.verifier)
    model, engine = verifier.get()
    eos = set(eos_token_ids(model, tokenizer))
    ids_of, train_rows, eval_rows = _training_rows(cfg, tokenizer)
    generator = torch.Generator().manual_seed(cfg.seed)
    partial = torch.load(partial_path, weights_only=False) if partial_path.is_file() else None
    if partial is None or partial["settings"] != settings:
        partial = {"settings": settings, "train": [], "prompts_done": 0, "generator": generator.get_state()}
    generator.set_state(partial["generator"])
    train, done = partial["train"], partial["prompts_done"]
    for r in tqdm(train_rows[done:], desc="verifier samples (train)", unit="prompt", initial=done, total=len(train_rows)):
        for index in range(cfg.samples_per_prompt):
            train.append(_continue(
                engine, ids_of[r["question_id"]], cfg.sample_tokens, layers, vocab_ids, cfg.target_top_k, eos,
                None if index == 0 else generator,
            ))
        done += 1
        if done % 10 == 0:
            atomic_save({"settings": settings, "train": train, "prompts_done": done, "generator": generator.get_state()}, partial_path)
    evaluation = []
    for r in tqdm(eval_rows, desc="verifier greedy (held out)", unit="prompt"):
        evaluation.append(_continue(engine, ids_of[r["question_id"]], cfg.eval_tokens, layers, vocab_ids, cfg.target_top_k, eos, None))
    return {
        "train": [s for s in train if s is not None],
        "eval": [s for s in evaluation if s is not None],
        "train_question_ids": [r["question_id"] for r in train_rows],
        "eval_question_ids": [r["question_id"] for r in eval_rows],
    }


def run_feature_head(cfg: FeatureHeadConfig) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    started = time.time()
    base = load_model_weights_only(cfg.verifier, torch.float32)
    layers = cfg.layers or default_layers(base.config.num_hidden_layers)
    vocab_file = Path(resolve_alias(cfg.draft_vocab_from)) / "draft_vocab.json"
    if not vocab_file.is_file():
        raise ConfigError(f"draft_vocab_from: {cfg.draft_vocab_from} has no draft_vocab.json")
    vocab_ids = json.loads(vocab_file.read_text())

    data_settings = {k: getattr(cfg, k) for k in (
        "verifier", "verifier_dtype", "draft_vocab_from", "prompts", "max_prompt_tokens", "sample_tokens", "samples_per_prompt",
        "target_top_k", "eval_prompts", "eval_tokens", "seed", "device", "self_instruct_prompts",
    )}
    data_settings["layers"] = layers
    verifier = _ServedVerifier(cfg)
    vocab_tensor = torch.tensor(vocab_ids)
    data = load_or_make(
        out / "samples.pt", data_settings, lambda: _collect(cfg, verifier, layers, vocab_tensor, out / "samples.partial.pt", data_settings),
        weights_only=False,
    )
    train = data["train"]
    if cfg.prompt_text:
        text_settings = {
            k: data_settings[k] for k in ("verifier", "verifier_dtype", "draft_vocab_from", "prompts", "target_top_k", "layers", "device")
        }
        text_settings["text_chunk_tokens"] = cfg.text_chunk_tokens
        text = load_or_make(
            out / "prompt_text.pt", text_settings, lambda: {"samples": _collect_text(cfg, verifier, layers, vocab_tensor)},
            weights_only=False,
        )
        train = train + text["samples"]
    train = sorted(train, key=lambda s: len(s.tokens))  # neighbours batch with little padding

    head = FeatureHead.from_verifier(base, layers, vocab_ids).to(cfg.device)
    del base
    torch.backends.cuda.matmul.allow_tf32 = True  # the head's training; the verifier's samples above ran in full float32
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = warmup_then_linear(optimizer, cfg.steps, floor=0.05)
    checkpoint = Checkpoint(out, dataclasses.asdict(cfg), optimizer, schedule)
    step, history, before = 0, [], None
    if (state := checkpoint.resume()) is not None:
        head.load_state_dict(state["head"], strict=False)
        step, history, before = state["step"], state["history"], state["before"]
    if before is None:
        before = evaluate(head, data["eval"], cfg.unroll)
        print("before:", json.dumps(before))
    bar = tqdm(total=cfg.steps, initial=step, desc="feature head", unit="step")
    while step < cfg.steps:
        anchor = random.randrange(len(train))
        batch = train[max(0, anchor - cfg.batch_size // 2) :][: cfg.batch_size]
        loss = unrolled_loss(head, batch, cfg.unroll)
        train_step(loss, trainable, optimizer, schedule)
        step += 1
        history.append({"step": step, "loss": loss.item()})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            trained = {k: v for k, v in head.state_dict().items() if not k.startswith(("embed.", "lm_head."))}
            checkpoint.save(step=step, history=history, before=before, head=trained)
    bar.close()
    head.eval()
    after = evaluate(head, data["eval"], cfg.unroll)
    print("after:", json.dumps(after))
    recipe = dataclasses.asdict(cfg)
    save_feature_head(out / "feature_head", head, cfg.verifier, recipe, cfg.dtype)
    report = {
        "recipe": recipe,
        "train_question_ids": data["train_question_ids"],
        "eval_question_ids": data["eval_question_ids"],
        "train_samples": len(train),
        "train_positions": sum(len(s.tokens) - s.prompt_len for s in train),
        "self_instruct_prompts_kept": data.get("self_instruct_prompts", 0),
        "before": before,
        "after": after,
        "history": history,
        "seconds": time.time() - started,
        "feature_head_dir": str(out / "feature_head"),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'feature_head'} and {out / 'report.json'}")
    return report


LIST_HELP = {"layers": "comma-separated verifier depths fused (3 indices into output_hidden_states)"}
