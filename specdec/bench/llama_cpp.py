"""The CPU anchor: llama.cpp decoding the served verifier's own GGUF file. Through llama-cpp-python
(the `llamacpp` extra): plain and with its prompt-lookup decoding, rows the bench adds when the
package is installed and the verifier comes from a GGUF file. Through `llama-speculative-simple`
(scripts/build_llama_cpp.sh; `specdec bench --llama-cpp`): plain, with a draft model of the same
vocabulary, or with its n-gram drafting. Nothing else needs either."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.core.fetch import cache_dir
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


@dataclass(frozen=True)
class LlamaCppMode:
    """One way `llama-speculative-simple` decodes: `none` (plain decoding), `draft-simple` (a draft
    model of the same vocabulary, up to `draft_max` tokens a round, each drafted only while the
    draft model's probability is at least `p_min`), or one of its n-gram types."""

    spec_type: str
    draft_max: int = 0  # 0: llama.cpp's default
    p_min: float = 0.0  # 0: llama.cpp's default

    @classmethod
    def parse(cls, text: str) -> "LlamaCppMode":
        """TYPE[:DRAFT_MAX[:P_MIN]], e.g. none, ngram-simple, draft-simple:8:0.75."""
        spec_type, *rest = text.split(":")
        if spec_type not in SPEC_TYPES or len(rest) > 2:
            raise ValueError(f"llama.cpp mode {text!r}: expected TYPE[:DRAFT_MAX[:P_MIN]] with TYPE one of {', '.join(SPEC_TYPES)}")
        return cls(spec_type, int(rest[0]) if rest else 0, float(rest[1]) if len(rest) > 1 else 0.0)

    @property
    def name(self) -> str:
        if self.spec_type == "none":
            return "llama_cpp_cli"
        suffix = (f"_{self.draft_max}" if self.draft_max else "") + (f"_p{self.p_min:g}" if self.p_min else "")
        return "llama_cpp_" + self.spec_type.replace("-", "_") + suffix

    @property
    def needs_draft_model(self) -> bool:
        return self.spec_type == "draft-simple"


SPEC_TYPES = ("none", "draft-simple", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def _installed(name: str) -> Path:
    """Where scripts/build_llama_cpp.sh installs `llama-completion`, `llama-speculative-simple` and `llama-bench`."""
    return cache_dir() / "llama.cpp" / "bin" / name


def llama_cpp_binary(name: str) -> Path:
    """One of the built binaries, or an error that says how to build it."""
    binary = _installed(name)
    if not binary.is_file():
        raise FileNotFoundError(f"{binary} is not built: run scripts/build_llama_cpp.sh (~10 minutes on 2 cores)")
    return binary


@dataclass
class LlamaCppRun:
    text: str
    seconds: float  # the prompt's read and the decoding, as llama.cpp times them (not its model loading)
    drafted: int
    accepted: int


class LlamaCppBinary:
    """llama.cpp on the verifier's GGUF file, one process per prompt (each starts from an empty
    cache, as the bench's stacks do): `llama-completion` for plain decoding, else
    `llama-speculative-simple`. The prompt goes as text with its special tokens spelled out,
    which llama.cpp reads back as those tokens (as an argument: a prompt file loses its last newline)."""

    SPEC_TIMES = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")
    PLAIN_TIMES = re.compile(r"(prompt eval|\beval) time =\s+([\d.]+) ms /\s+(\d+)")
    COUNTS = re.compile(r"n_(drafted|accept)\s+=\s+(\d+)")

    def __init__(self, gguf: Path, mode: LlamaCppMode, threads: int, draft_gguf: Path | None = None, context: int = 4096):
        if mode.needs_draft_model and draft_gguf is None:
            raise ValueError(f"llama.cpp mode {mode.spec_type} needs a draft model (--llama-cpp-draft)")
        self.plain = mode.spec_type == "none"
        binary = llama_cpp_binary("llama-completion" if self.plain else "llama-speculative-simple")
        self.command = [str(binary), "-m", str(gguf), "-c", str(context), "-t", str(threads), "-tb", str(threads), "--no-escape"]
        if self.plain:
            self.command += ["-no-cnv", "--no-display-prompt"]
        else:
            self.command += ["--spec-type", mode.spec_type]
        if mode.needs_draft_model:
            self.command += ["-md", str(draft_gguf), "-td", str(threads), "-tbd", str(threads)]
        if mode.draft_max:
            self.command += ["--spec-draft-n-max", str(mode.draft_max)]
        if mode.p_min:
            self.command += ["--spec-draft-p-min", str(mode.p_min)]

    def generate(self, prompt: str, max_new_tokens: int, temperature: float, seed: int) -> LlamaCppRun:
        request = ["-p", prompt, "-n", str(max_new_tokens), "--temp", str(temperature), "--seed", str(seed)]
        done = subprocess.run(self.command + request, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"{' '.join(self.command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        log = done.stdout + done.stderr
        if self.plain:
            times = {kind: float(ms) / 1e3 for kind, ms, _ in self.PLAIN_TIMES.findall(log)}
        else:
            times = {kind: float(seconds) for kind, _, seconds in self.SPEC_TIMES.findall(log)}
        text = generated_text(done.stdout, prompt, self.plain)
        if len(times) != 2:
            raise RuntimeError(f"no timings in llama.cpp's output:\n{log[-3000:]}")
        counts = {kind: int(n) for kind, n in self.COUNTS.findall(log)}
        return LlamaCppRun(text, sum(times.values()), counts.get("drafted", 0), counts.get("accept", 0))


def generated_text(stdout: str, prompt: str, plain: bool) -> str:
    """The new text in a binary's standard output: llama-completion prints it and a newline (after
    " [end of text]" where it stopped at one); llama-speculative-simple prints two newlines, the
    prompt, the new text and two newlines."""
    if plain:
        return stdout.removesuffix("\n").removesuffix(" [end of text]")
    return stdout.split(prompt, 1)[-1].removesuffix("\n\n")


def bench_built() -> bool:
    return _installed("llama-bench").is_file()


def pass_ms(gguf: Path, tokens: list[int], context: int, threads: int) -> dict[int, float]:
    """llama.cpp's time for a pass of k new tokens after `context` tokens, for each k: `llama-bench`'s
    prompt test of k tokens at that depth, one repetition after its warm-up (its passes compute the
    last token's logits only, where a verifier's pass needs all k)."""
    command = [str(llama_cpp_binary("llama-bench")), "-m", str(gguf), "-t", str(threads), "-d", str(context),
               "-p", ",".join(map(str, tokens)), "-n", "0", "-r", "1", "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return bench_pass_ms(done.stdout)


def bench_pass_ms(report: str) -> dict[int, float]:
    """k -> ms of each prompt test in `llama-bench -o json`'s report."""
    return {test["n_prompt"]: test["avg_ns"] / 1e6 for test in json.loads(report) if test["n_prompt"] > 0}
