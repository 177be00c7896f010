"""The bench's CPU anchor: llama.cpp rows on the verifier's own GGUF file (optional extra)."""
from __future__ import annotations

import pytest

from specdec.bench.llama_cpp import bench_built, installed, verifier_gguf
from specdec.core.hub import BUILTIN_SMOLLM2


def test_the_anchor_reads_the_verifiers_own_gguf_file(tiny_dirs):
    gguf = verifier_gguf(BUILTIN_SMOLLM2)
    assert gguf is not None and gguf.suffix == ".gguf" and gguf.is_file()
    assert verifier_gguf(str(tiny_dirs["verifier"])) is None  # safetensors: no llama.cpp rows
    assert verifier_gguf("/no/such/model.gguf") is None


@pytest.mark.skipif(not installed(), reason="llama-cpp-python is the optional `llamacpp` extra")
@pytest.mark.parametrize("prompt_lookup", [False, True], ids=["plain", "prompt_lookup"])
def test_llama_cpp_decodes_the_gguf_greedily_and_stops_where_asked(prompt_lookup):
    from specdec.bench.llama_cpp import LlamaCppDecoder
    from specdec.core.models import load_tokenizer
    from specdec.core.prompts import chat_ids

    tokenizer = load_tokenizer(BUILTIN_SMOLLM2)
    ids = chat_ids(tokenizer, "Name three colours.")
    decoder = LlamaCppDecoder(verifier_gguf(BUILTIN_SMOLLM2), 2, {tokenizer.eos_token_id}, prompt_lookup=prompt_lookup)
    first, seconds = decoder.generate(ids, 12, 0.0, seed=0)
    again, _ = decoder.generate(ids, 12, 0.0, seed=1)
    assert len(first) == 12 and seconds > 0 and first == again  # greedy: the seed changes nothing
    assert tokenizer.decode(first).strip()  # text in the verifier's own vocabulary


def test_llama_cpp_modes_parse_and_name_their_rows():
    from specdec.bench.llama_cpp import LlamaCppMode

    assert LlamaCppMode.parse("none").name == "llama_cpp_cli"
    mode = LlamaCppMode.parse("draft-simple:8:0.75")
    assert (mode.spec_type, mode.draft_max, mode.p_min, mode.needs_draft_model) == ("draft-simple", 8, 0.75, True)
    assert mode.name == "llama_cpp_draft_simple_8_p0.75"
    assert LlamaCppMode.parse("ngram-mod").name == "llama_cpp_ngram_mod" and not LlamaCppMode.parse("ngram-mod").needs_draft_model
    for bad in ("eagle", "draft-simple:8:0.75:1", "none:x"):
        with pytest.raises(ValueError):
            LlamaCppMode.parse(bad)


def test_the_new_text_is_read_from_each_binarys_output():
    """Outputs as the two binaries print them (llama.cpp 0.3.36's, SmolLM2, 6 tokens)."""
    from specdec.bench.llama_cpp import generated_text

    prompt = "The capital of France is"
    assert generated_text(" Paris.\n\nThe United\n", prompt, plain=True) == " Paris.\n\nThe United"
    assert generated_text(" Paris. [end of text]\n", prompt, plain=True) == " Paris."
    spec = "\n\nThe capital of France is Paris.\n\nThe United States\n\n\n"
    assert generated_text(spec, prompt, plain=False) == " Paris.\n\nThe United States\n"


def test_llama_cpp_rows_say_what_they_lack(tmp_path, monkeypatch):
    """Without the built binaries, or a draft model for draft-simple, the rows refuse with the fix."""
    from specdec.bench.llama_cpp import LlamaCppBinary, LlamaCppMode

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    gguf = verifier_gguf(BUILTIN_SMOLLM2)
    with pytest.raises(FileNotFoundError, match="run scripts/build_llama_cpp.sh"):
        LlamaCppBinary(gguf, LlamaCppMode.parse("ngram-mod"), 2)
    with pytest.raises(ValueError, match="needs a draft model"):
        LlamaCppBinary(gguf, LlamaCppMode.parse("draft-simple:3"), 2)


def test_llama_benchs_report_gives_each_prompt_tests_time():
    """`llama-bench -o json`'s report (llama.cpp 0.3.36's fields, trimmed): k -> ms of a pass of k tokens."""
    from specdec.bench.llama_cpp import bench_pass_ms

    report = """[
      {"n_prompt": 1, "n_gen": 0, "n_depth": 200, "avg_ns": 26168552, "samples_ns": [26168552]},
      {"n_prompt": 9, "n_gen": 0, "n_depth": 200, "avg_ns": 124000000, "samples_ns": [124000000]},
      {"n_prompt": 0, "n_gen": 16, "n_depth": 200, "avg_ns": 453000000, "samples_ns": [453000000]}
    ]"""
    assert bench_pass_ms(report) == {1: 26.168552, 9: 124.0}


@pytest.mark.skipif(not bench_built(), reason="llama-bench is built by scripts/build_llama_cpp.sh")
def test_llama_bench_times_passes_of_k_tokens_after_a_context():
    from specdec.bench.llama_cpp import pass_ms

    ms = pass_ms(verifier_gguf(BUILTIN_SMOLLM2), [1, 3], 8, 2)
    assert set(ms) == {1, 3} and all(value > 0 for value in ms.values())


@pytest.mark.skipif(not bench_built(), reason="llama-bench is built by scripts/build_llama_cpp.sh")
def test_the_cost_curve_times_llama_cpps_passes_after_each_round():
    from specdec.bench.cost import LLAMA_CPP, time_engines

    rows = time_engines({}, list(range(1, 9)), [1, 3], repeats=2, llama_cpp_gguf=verifier_gguf(BUILTIN_SMOLLM2))
    assert [(row["engine"], row["tokens"]) for row in rows] == [(LLAMA_CPP, 1), (LLAMA_CPP, 3)]
    assert all(row["verify_ms"] > 0 and len(row["paired_interval"]) == 2 for row in rows)
