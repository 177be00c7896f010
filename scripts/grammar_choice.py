"""Measures the grammar libraries structured outputs could use, on a tokenizer of the project's
models: the one-time tokenizer setup, each constraint's compile time, the token mask's time per
token along a valid answer, and what a draft tree needs (a matcher state per path: a copy, or a
rollback and a re-consume). Prints a table and writes JSON.

    pip install llguidance xgrammar    # xgrammar brings triton and apache-tvm-ffi
    python scripts/grammar_choice.py --tokenizer DIR --out docs/benchmarks/grammar_choice.json

DIR: a saved Hugging Face tokenizer (e.g. `load_tokenizer("qwen2.5-coder-1.5b-instruct").save_pretrained(DIR)`)."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

FUNCTION_SCHEMA = {  # a JSON description of a function, as `specdec bench --prompts json` would ask for
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "parameters": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
                "required": ["name", "type"], "additionalProperties": False,
            },
        },
        "returns": {"type": "string"},
        "example_call": {"type": "string"},
    },
    "required": ["name", "parameters", "returns", "example_call"],
    "additionalProperties": False,
}
FUNCTION_ANSWER = json.dumps({
    "name": "below_zero",
    "parameters": [{"name": "operations", "type": "List[int]"}],
    "returns": "bool",
    "example_call": "below_zero([1, 2, -4, 5])",
})
DATE_REGEX = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["positive", "negative", "neutral"]
ARITHMETIC_LARK = """start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
ARITHMETIC_EBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
# constraint -> (an answer it accepts, for the per-token walk)
ANSWERS = {"json_schema": FUNCTION_ANSWER, "json_object": FUNCTION_ANSWER, "regex": "2026-11-28",
           "choice": "negative", "grammar": "(12+7)*3-40/5"}


def timed(fn, repeats: int = 1) -> tuple[float, object]:
    """Median milliseconds of `repeats` calls, and the last call's result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), result


def summary(samples_us: list[float]) -> dict:
    ordered = sorted(samples_us)
    return {"median_us": round(statistics.median(ordered), 1), "p99_us": round(ordered[int(0.99 * (len(ordered) - 1))], 1),
            "max_us": round(ordered[-1], 1)}


def measure_llguidance(tokenizer, repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    import numpy as np

    setup_ms, lltok = timed(lambda: llguidance.hf.from_tokenizer(tokenizer))
    matcher_of = llguidance.LLMatcher
    grammars = {
        "json_schema": matcher_of.grammar_from_json_schema(json.dumps(FUNCTION_SCHEMA)),
        "json_object": matcher_of.grammar_from_json_schema(json.dumps({"type": "object"})),
        "regex": matcher_of.grammar_from_regex(DATE_REGEX),
        "choice": matcher_of.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in CHOICES)),
        "grammar": matcher_of.grammar_from_lark(ARITHMETIC_LARK),
    }
    out = {"version": llguidance.__version__ if hasattr(llguidance, "__version__") else "", "tokenizer_setup_ms": round(setup_ms, 1)}
    bitmask = llguidance.numpy.allocate_token_bitmask(1, lltok.vocab_size)
    for kind, grammar in grammars.items():
        compile_ms, matcher = timed(lambda: matcher_of(lltok, grammar, log_level=0), repeats)
        assert not matcher.is_error(), matcher.get_error()
        masks, copies, rollbacks = [], [], []
        for token in tokenizer(ANSWERS[kind], add_special_tokens=False)["input_ids"]:
            start = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
            masks.append((time.perf_counter() - start) * 1e6)
            allowed = (bitmask[0, token // 32] >> np.int32(token % 32)) & 1
            assert allowed, f"{kind}: token {token} refused"
            start = time.perf_counter()
            matcher.deep_copy()
            copies.append((time.perf_counter() - start) * 1e6)
            assert matcher.consume_token(token), matcher.get_error()
            start = time.perf_counter()
            matcher.rollback(1)
            matcher.consume_token(token)
            rollbacks.append((time.perf_counter() - start) * 1e6)
        forced = len(matcher_of(lltok, grammars["json_schema"], log_level=0).compute_ff_tokens())
        out[kind] = {"compile_ms": round(compile_ms, 2), "tokens": len(masks), "mask": summary(masks), "copy": summary(copies),
                     "rollback_and_consume": summary(rollbacks), "accepting_at_end": matcher.is_accepting()}
    out["forced_tokens_at_json_schema_start"] = forced
    return out


def measure_xgrammar(tokenizer, repeats: int) -> dict:
    import xgrammar as xgr

    setup_ms, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))
    out = {"version": xgr.__version__ if hasattr(xgr, "__version__") else "", "tokenizer_setup_ms": round(setup_ms, 1)}
    compilers = {
        "json_schema": lambda c: c.compile_json_schema(json.dumps(FUNCTION_SCHEMA)),
        "json_object": lambda c: c.compile_json_schema(json.dumps({"type": "object"})),
        "regex": lambda c: c.compile_regex(DATE_REGEX),
        "choice": lambda c: c.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in CHOICES)),
        "grammar": lambda c: c.compile_grammar(ARITHMETIC_EBNF),
    }
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    for kind, compile_with in compilers.items():
        # A compiler of its own each time: its cache would answer every repeat after the first.
        compile_ms, compiled = timed(lambda: compile_with(xgr.GrammarCompiler(info, cache_enabled=False)), repeats)
        matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
        masks, copies, rollbacks = [], [], []
        for token in tokenizer(ANSWERS[kind], add_special_tokens=False)["input_ids"]:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            masks.append((time.perf_counter() - start) * 1e6)
            assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1, f"{kind}: token {token} refused"
            if hasattr(matcher, "fork"):
                start = time.perf_counter()
                matcher.fork()
                copies.append((time.perf_counter() - start) * 1e6)
            assert matcher.accept_token(token)
            start = time.perf_counter()
            matcher.rollback(1)
            matcher.accept_token(token)
            rollbacks.append((time.perf_counter() - start) * 1e6)
        out[kind] = {"compile_ms": round(compile_ms, 2), "tokens": len(masks), "mask": summary(masks),
                     "copy": summary(copies) if copies else None, "rollback_and_consume": summary(rollbacks),
                     "accepting_at_end": matcher.is_terminated() or matcher.accept_token(info.stop_token_ids[0])}
    return out


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    report = {"tokenizer": tokenizer.name_or_path, "vocab": len(tokenizer), "cpu": platform.processor() or platform.machine()}
    for name, measure in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        try:
            report[name] = measure(tokenizer, args.repeats)
        except ImportError as err:
            report[name] = {"error": f"not installed: {err}"}
    header = ("library", "constraint", "compile ms", "mask us (median/p99)", "copy us", "rollback+consume us")
    print("{:12s} {:12s} {:>10s} {:>22s} {:>8s} {:>20s}".format(*header))
    for name in ("llguidance", "xgrammar"):
        for kind in ANSWERS:
            row = report[name].get(kind)
            if row:
                copy = f"{row['copy']['median_us']:.1f}" if row["copy"] else "-"
                print(f"{name:12s} {kind:12s} {row['compile_ms']:10.2f} {row['mask']['median_us']:>10.1f} / {row['mask']['p99_us']:<9.1f} "
                      f"{copy:>8s} {row['rollback_and_consume']['median_us']:>20.1f}")
        print(f"{name:12s} tokenizer setup {report[name].get('tokenizer_setup_ms', '-')} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
