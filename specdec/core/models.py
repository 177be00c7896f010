"""Loading causal LMs (a plain model or a distilled drafter checkpoint) and their tokenizers,
and the checks a served model must pass."""
from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import gc
import hashlib
import json
import logging
import os
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from specdec.core.drafter_checkpoint import (
    base_model_of,
    is_drafter_checkpoint,
    load_drafter,
    scatter_head,
)
from specdec.core.draft_vocab import draft_vocab_ids
from specdec.core.engine import QUANTIZED, engine_for, torch_dtype
from specdec.core.blocks import BLOCK_FORMATS
from specdec.core.int8 import quantize_linears
from specdec.core.feature_head import is_feature_head
from specdec.core.feature_head import read_meta as read_feature_meta
from specdec.core.hub import (
    cache_dir,
    gguf_file_of,
    gguf_layer_formats,
    load_model_weights_only,
    load_tokenizer_of,
    resolve_alias,
)
from specdec.core.kernels import fingerprint, native
from specdec.core.kernels import sources as kernel_sources
from specdec.core.kquants import GGUF_TYPES, KQUANT_ROWS, load_gguf_linears
from specdec.core.prompts import calibration_ids
from specdec.core.timing import pass_times
from specdec.core.tree import DraftTree, verification_inputs

log = logging.getLogger(__name__)

AUTO = "auto"  # dtype auto: the fastest exact format on this machine's CPU (load_model)
AUTO_CONTEXT = 64  # committed tokens before the timed passes
AUTO_TOKENS = (1, 9)  # the verifier alone's step, and a speculating round's pass (8 drafted + 1)
AUTO_REPEATS = 5
# dtype auto keeps the first candidate (a GGUF's own blocks) unless another is this much faster: a
# near tie must not flip between machines of one CPU model (greedy text follows the weights).
AUTO_MARGIN = 0.05


@dataclass(frozen=True)
class ModelSpec:
    """Which model to load and how. `source` is a model name, a directory, a .gguf file or
    the built-in alias; `layers`, if set, keeps only the first that many decoder layers (a
    cheap self-drafter from the verifier's own weights)."""

    source: str
    layers: int | None = None
    dtype: str = "float32"  # the weight format: one of engine.WEIGHT_FORMATS, or auto (load_model)
    device: str = "cpu"
    # A drafter's head cut to this many of its most frequent tokens (specdec/core/draft_vocab.py); 0 = all.
    draft_vocab: int = 0
    # A GGUF file stored in other formats may be quantized again to the block format `dtype` names
    # (a drafter made smaller; by default a block format keeps the file's own blocks only).
    requantize: bool = False


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    source = resolve_alias(source)
    if is_drafter_checkpoint(source):
        source = base_model_of(source)
    elif is_feature_head(source):
        source = resolve_alias(read_feature_meta(source)["base_model"])
    return load_tokenizer_of(source)


_turn = threading.local()  # this thread's hold on the machine's turn (machine_turn), and its depth


@contextmanager
def machine_turn(exclusive: bool):
    """A turn at the lock beside the kept format choices, one per machine: dtype auto measures
    holding it alone, and every other model load holds it shared, so that no measurement runs
    beside another process's load (an int8 verifier's calibration keeps both cores busy, and a
    choice made beside it is kept for good). Nested turns (a measurement loading its candidates)
    take nothing more."""
    if getattr(_turn, "depth", 0):
        _turn.depth += 1
        try:
            yield
        finally:
            _turn.depth -= 1
        return
    lock = cache_dir() / "formats" / "measuring.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        _turn.depth = 1
        try:
            yield
        finally:
            _turn.depth = 0


def load_model(spec: ModelSpec) -> torch.nn.Module:
    """The model in eval mode, with logits over the whole vocabulary (a distilled drafter with a
    reduced draft vocabulary gives -inf outside it), its weights in the format `spec.dtype`
    names (specdec/core/engine.py; auto: the one `_load_fastest` picks), kept as the model's
    `weight_format`."""
    if spec.dtype == AUTO:
        return _load_fastest(spec)
    start = time.perf_counter()
    with machine_turn(exclusive=False):
        model = _load(spec)
    log.info("loaded %s as %s in %.1f s", spec.source, spec.dtype, time.perf_counter() - start)
    return model


def _load(spec: ModelSpec) -> torch.nn.Module:
    if spec.dtype in BLOCK_FORMATS and not spec.requantize:
        _check_block_format(spec)
    gguf = _gguf_path(spec) if spec.dtype == "gguf" else None
    dtype = torch_dtype(spec.dtype)
    source = resolve_alias(spec.source)
    if is_drafter_checkpoint(source):
        model, _ = load_drafter(source, dtype)
    else:
        model = load_model_weights_only(spec.source, dtype)
    if spec.layers is not None:
        truncate_layers(model, spec.layers)
    if spec.draft_vocab:
        if getattr(model, "draft_vocab_ids", None) is not None:
            raise ValueError(f"draft_vocab: {spec.source} has a draft vocabulary of its own")
        tokenizer = load_tokenizer(spec.source)
        multiple = KQUANT_ROWS if gguf is not None else 1  # the file's K-quant head packs rows in groups
        scatter_head(model, draft_vocab_ids(tokenizer, spec.draft_vocab, tokenizer_fingerprint(tokenizer), multiple))
    if gguf is not None:
        load_gguf_linears(model, gguf)
    elif spec.dtype in QUANTIZED:
        calibration = calibration_ids(load_tokenizer(spec.source), max_context(model))
        quantize_linears(model, input_ranges(model.eval(), calibration), None if spec.dtype == "int8" else spec.dtype)
    model.weight_format = spec.dtype
    _return_freed_memory()  # the float copies quantizing made
    return model.to(spec.device).eval()


def _return_freed_memory() -> None:
    """glibc keeps freed heap memory for later allocations: a load's temporaries (gigabytes for
    a 1.5B in int8) go back to the system instead of staying in the server's resident size."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def exact_formats(spec: ModelSpec) -> list[str]:
    """The formats dtype auto chooses among: int8 for any model, and gguf where the source is a
    GGUF file whose layers the engine serves as stored (kquants.GGUF_TYPES)."""
    stored = gguf_layer_formats(spec.source)
    return ["gguf", "int8"] if stored and stored <= set(GGUF_TYPES) else ["int8"]


def cpu_identity() -> tuple[str, str]:
    """This CPU's model name and flags (/proc/cpuinfo's first processor; "" where unknown)."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return "", ""
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}
    return fields.get("model name", ""), fields.get("flags", "")


def format_choice_path(spec: ModelSpec, candidates: list[str]) -> Path:
    """Where dtype auto keeps its choice for `spec` among `candidates` on this machine: one file
    per CPU (its model name and flags), model source, candidates, kernels' sources (or the torch ops
    where the kernels are not built) and torch thread count, in the cache directory."""
    name, flags = cpu_identity()
    kernels = fingerprint(kernel_sources()) if native() is not None else "torch ops"
    key = {
        "cpu": name, "cpu_flags": hashlib.sha256(flags.encode()).hexdigest(), "source": spec.source, "layers": spec.layers,
        "candidates": candidates, "kernels": kernels, "threads": torch.get_num_threads(),
    } | ({"draft_vocab": spec.draft_vocab} if spec.draft_vocab else {})
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "formats" / f"{digest}.json"


def _load_fastest(spec: ModelSpec) -> torch.nn.Module:
    """dtype auto: the model in the fastest of its exact formats (`exact_formats`) on this CPU.
    Each candidate is loaded and its engine times a pass of 1 and of 9 new tokens after a
    64-token context (interleaved, medians of 5 repetitions); the rule (`choose_format`): the
    smallest T(1) + T(9) wins, the verifier alone's step and a speculating round's pass weighted
    equally, by at least 5% against the GGUF's own blocks. The choice
    and its times are kept as JSON (`format_choice_path`), so later starts load the winner alone.
    A measurement runs while no other process on the machine measures or loads a model
    (`machine_turn`)."""
    choice = _known_choice(spec)
    if choice is None:
        with machine_turn(exclusive=True):
            choice = _known_choice(spec)  # another process may have measured it while this one waited
            if choice is None:
                return _measure_fastest(spec)
    return load_model(dataclasses.replace(spec, dtype=choice))


def _measure_fastest(spec: ModelSpec) -> torch.nn.Module:
    """Loads and times every candidate, keeps the choice, and returns the winner (the others freed)."""
    candidates = exact_formats(spec)
    path = format_choice_path(spec, candidates)
    models = {c: load_model(dataclasses.replace(spec, dtype=c)) for c in candidates}
    vocab = next(iter(models.values())).config.vocab_size
    context = [(7 + 31 * i) % vocab for i in range(AUTO_CONTEXT)]
    times = pass_times({c: (engine_for(m, c), list(AUTO_TOKENS)) for c, m in models.items()}, context, AUTO_REPEATS)
    times_ms = {c: {f"T({k})": round(statistics.median(times[c, k]), 3) for k in AUTO_TOKENS} for c in candidates}
    choice = choose_format(times_ms)
    staging = path.with_name(path.name + f".tmp{os.getpid()}")
    staging.write_text(json.dumps({"source": spec.source, "choice": choice, "times_ms": times_ms, "cpu": cpu_identity()[0]}))
    staging.rename(path)
    log.info("dtype auto for %s: %s (measured, ms %s; kept in %s)", spec.source, choice, times_ms, path)
    winner = models.pop(choice)
    del models
    gc.collect()  # the other candidates' weights go now, not at some later collection
    _return_freed_memory()
    return winner


def choose_format(times_ms: dict[str, dict[str, float]]) -> str:
    """The rule: the candidate (in `exact_formats` order) with the smallest T(1) + T(9), except that
    the first is kept unless the fastest beats it by AUTO_MARGIN."""
    total = {c: sum(t.values()) for c, t in times_ms.items()}
    first, fastest = next(iter(total)), min(total, key=total.get)
    return fastest if total[fastest] < (1 - AUTO_MARGIN) * total[first] else first


def _known_choice(spec: ModelSpec) -> str | None:
    """dtype auto's choice where it needs no measurement: the only exact format, or the one kept
    for this machine; None where the candidates must be timed."""
    candidates = exact_formats(spec)
    if len(candidates) == 1:
        log.info("dtype auto for %s: %s, its only exact format", spec.source, candidates[0])
        return candidates[0]
    path = format_choice_path(spec, candidates)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or a torn file: measure again
        return None
    if record.get("choice") not in candidates:
        return None
    log.info("dtype auto for %s: %s (chosen before, ms %s; %s)", spec.source, record["choice"], record.get("times_ms"), path)
    return record["choice"]


def weight_format_of(spec: ModelSpec) -> str:
    """The format `load_model(spec)` serves: `spec.dtype`, or for auto the choice kept for this
    machine (made now, loading the candidates, where none is kept)."""
    if spec.dtype != AUTO:
        return spec.dtype
    return _known_choice(spec) or load_model(spec).weight_format


def _gguf_path(spec: ModelSpec) -> Path:
    """The GGUF file whose own blocks dtype `gguf` serves."""
    gguf = gguf_file_of(spec.source)
    if gguf is None:
        raise UnsupportedModel(f"dtype gguf serves a GGUF file's own blocks; {spec.source} is not a GGUF file")
    return gguf


def _check_block_format(spec: ModelSpec) -> None:
    """A GGUF file is served in a block format only when its layers are stored in it, so that
    its blocks stay as they are (any other model is quantized to blocks at load)."""
    stored = gguf_layer_formats(spec.source)
    if stored is not None and stored != {spec.dtype.upper()}:
        raise UnsupportedModel(
            f"{spec.source} stores its layers as {', '.join(sorted(stored))}; dtype {spec.dtype} keeps a GGUF's "
            f"{spec.dtype.upper()} blocks as they are and takes no other format (int8 and float32 read any; "
            f"model.requantize: true quantizes its weights again)"
        )


def input_ranges(model: torch.nn.Module, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """The largest |input| per input channel that each linear layer sees on `token_ids`."""
    ranges: dict[str, torch.Tensor] = {}

    def recorder(name: str):
        def record(module, inputs):
            seen = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(dim=0).float()
            ranges[name] = torch.maximum(ranges[name], seen) if name in ranges else seen

        return record

    hooks = [m.register_forward_pre_hook(recorder(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([token_ids], device=model.device))
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


def truncate_layers(model: torch.nn.Module, num_layers: int) -> None:
    layers = model.model.layers
    if not 0 < num_layers <= len(layers):
        raise ValueError(f"layers must be in [1, {len(layers)}] for this model, got {num_layers}")
    model.model.layers = layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The model's own greedy `generate()` continuation: the reference that every exact
    decoding path must equal token for token."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Two tokenizers with the same fingerprint turn text into the same ids and back."""
    payload = json.dumps(
        {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(tokenizer.all_special_tokens)},
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def eos_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end generation, as generate() sees them (generation config first)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return sorted({eos} if isinstance(eos, int) else set(eos))


def max_context(model: torch.nn.Module) -> int:
    return int(getattr(model.config, "max_position_embeddings", 2048))


def set_torch_threads(threads: int) -> None:
    """0 = one thread per core (Ray sets OMP_NUM_THREADS low for zero-CPU actors)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)


class UnsupportedModel(ValueError):
    pass


def check_tree_attention(engine, config) -> None:
    """Verifies a tiny draft tree in one pass of `engine` and compares every node's logits
    with a plain pass over its path. Architectures that ignore a custom 4-D mask or position
    ids (e.g. some with ALiBi or sliding windows) are refused here, before they could verify
    trees wrongly."""
    vocab = config.vocab_size
    context = [t % vocab for t in (1, 5, 7, 3, 9)]
    tree = DraftTree([t % vocab for t in (4, 6, 8, 10, 11)], [-1, -1, 0, 0, 1])
    refusal = (
        f"model type '{config.model_type}' does not honour a custom 4-D attention mask with position ids, "
        "so it cannot verify or draft a tree in one pass; use a Llama, Qwen2, Mistral, GPT-2 or another family that does"
    )
    try:
        with torch.inference_mode():
            cache = engine.new_cache()
            engine(cache, context[:3])
            positions, mask = verification_inputs(tree, 3, 2)
            logits, _ = engine(cache, context[3:] + tree.token_ids, len(tree), position_ids=positions, attention_mask=mask)
            paths = [context + [tree.token_ids[n] for n in tree.path_to(node)] for node in range(len(tree))]
            reference = torch.cat([engine(engine.new_cache(), path)[0] for path in paths])
    except Exception as err:  # an architecture that rejects the mask outright
        raise UnsupportedModel(f"{refusal} ({type(err).__name__}: {err})") from None
    finite = torch.isfinite(reference)
    scale = reference[finite].abs().max().clamp_min(1.0)
    tolerance = 1e-3 if getattr(config, "dtype", None) in (None, torch.float32) else 3e-2
    if not torch.equal(finite, torch.isfinite(logits)) or ((logits - reference)[finite].abs().max() / scale) > tolerance:
        raise UnsupportedModel(refusal)
