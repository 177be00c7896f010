"""The CPU anchor: llama.cpp (through llama-cpp-python, the `llamacpp` extra) decoding the served
verifier's own GGUF file, plain and with its prompt-lookup decoding. The bench adds these rows
when the package is installed and the verifier comes from a GGUF file; nothing else needs it."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from specdec.core.hub import gguf_file_of

PROMPT_LOOKUP_TOKENS = 10  # llama-cpp-python's documented example value


def verifier_gguf(source: str) -> Path | None:
    """The GGUF file the verifier's weights come from, or None (a safetensors model)."""
    try:
        return gguf_file_of(source)
    except FileNotFoundError:
        return None


def installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppDecoder:
    """One llama.cpp model over the GGUF file; each call starts from an empty cache, as the
    bench's stacks do (no prefix cache), and stops at the verifier's EOS tokens."""

    def __init__(self, gguf: Path, threads: int, eos_ids: set[int], prompt_lookup: bool = False, context: int = 4096):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS) if prompt_lookup else None
        self.model = Llama(
            model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads, draft_model=draft, verbose=False
        )
        self.eos_ids = eos_ids

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> tuple[list[int], float]:
        """(new token ids, seconds), the prompt's prefill included."""
        self.model.reset()
        self.model.set_seed(seed)
        sampling = {"temp": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0} if temperature > 0 else {"temp": 0.0}
        new: list[int] = []
        start = time.perf_counter()
        for token in self.model.generate(prompt_ids, repeat_penalty=1.0, reset=True, **sampling):
            new.append(token)
            if token in self.eos_ids or len(new) == max_new_tokens:
                break
        return new, time.perf_counter() - start
