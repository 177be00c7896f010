"""`specdec bench` end to end on tiny models: the speed comparison over both placements with the
oracle's rows, over two verifier weight formats, and the study modes (the cost curve, the
weight formats' quality) through the same command line."""
from __future__ import annotations

import json

import pytest
import yaml

from specdec.cli import main
from tests.conftest import tiny_config

PROMPTS = [  # held-out ids (a multiple of 4), short enough for the tiny models' 128 positions
    {"question_id": 4, "category": "writing", "turns": ["write a b c"]},
    {"question_id": 8, "category": "math", "turns": ["one two three"]},
]


@pytest.fixture
def bench_files(tiny_dirs, tmp_path):
    config, prompts = tmp_path / "tiny.yaml", tmp_path / "prompts.jsonl"
    config.write_text(yaml.safe_dump(tiny_config(tiny_dirs)))
    prompts.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return ["--config", str(config), "--prompts", str(prompts), "--num-prompts", "2"], tmp_path


@pytest.mark.slow  # 70 s; the bench through the services runs in CI as test_bench_without_in_process_rows_compares_the_services_alone
def test_bench_compares_both_placements_with_the_oracle_ceiling(bench_files):
    common, tmp_path = bench_files
    out = tmp_path / "bench.json"
    assert main(["bench", *common, "--drafters", "oracle", "--placements", "split,colocated", "--max-new-tokens", "12",
                 "--budgets", "3", "--trees", "chain", "--out", str(out)]) == 0
    rows = {row["name"]: row for row in json.loads(out.read_text())["results"]}
    for placement in ("split", "colocated"):
        alone, oracle = rows[f"{placement}/autoregressive"], rows[f"{placement}/chain_b3"]
        assert alone["placement"] == oracle["placement"] == placement and oracle["drafter"] == "oracle"
        assert oracle["greedy_matches_verifier_alone"] == 1.0
        # Every drafted token kept: three a round, less only where a request's last round is shorter.
        assert oracle["mean_accepted_per_round"] > 2.0 and oracle["round_anatomy"]["speculative"]["rounds"] > 0
    assert rows["hf_generate_fp32"]["greedy_matches_verifier_alone"] == 1.0  # the tiny pair runs float32 weights
    assert {"bench.png", "bench_anatomy.png"} <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.slow  # 30 s of bench plumbing; the formats' exactness through the services is test_engine.py's
def test_bench_compares_verifier_weight_formats_each_against_its_own_verifier_alone(bench_files):
    common, tmp_path = bench_files
    out = tmp_path / "formats.json"
    assert main(["bench", *common, "--verifier-formats", "int8,q4_1", "--max-new-tokens", "8", "--budgets", "3", "--trees", "chain",
                 "--out", str(out)]) == 0
    rows = {row["name"]: row for row in json.loads(out.read_text())["results"]}
    for dtype in ("int8", "q4_1"):
        alone, speculative = rows[f"{dtype}/autoregressive"], rows[f"{dtype}/chain_b3"]
        assert alone["verifier_dtype"] == speculative["verifier_dtype"] == dtype
        assert speculative["greedy_matches_verifier_alone"] == 1.0 and speculative["round_anatomy"]["speculative"]["rounds"] > 0


def test_bench_measures_the_weight_formats_quality(bench_files):
    common, tmp_path = bench_files
    out = tmp_path / "quality.json"
    assert main(["bench", *common, "--weight-quality", "--weight-formats", "int8,q4_1", "--max-new-tokens", "8", "--out", str(out)]) == 0
    rows = {row["format"]: row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {"int8", "q4_1"} and all(row["positions"] == 16 for row in rows.values())
    assert all(0.5 < row["top1_agreement"] <= 1.0 and 0.0 <= row["kl_nats"] < 0.5 for row in rows.values())
    assert (tmp_path / "quality.png").exists()


def test_bench_runs_a_study_mode_and_writes_its_report(bench_files):
    common, tmp_path = bench_files
    out = tmp_path / "cost.json"
    assert main(["bench", *common, "--cost-curve", "1,3", "--cost-context", "16", "--roofline", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {row["tokens"] for row in report["results"] if row["model"] == "verifier"} == {1, 3}
    # each verifier engine's roof, max(bytes / bandwidth, k x multiply-adds / peak), rising with k
    assert set(report["roofline"]) == {row["engine"] for row in report["results"] if row["model"] == "verifier"}
    for engine, roof in report["roofline"].items():
        assert roof["bytes"] > 0 and roof["macs_per_token"] > 0 and roof["peak_macs_per_s"] > 0 and roof["bandwidth_bytes_per_s"] > 1e9
        # the rates are read after every timed round, and each pass is set against its own round's roof
        assert len(roof["bandwidth_bytes_per_s_by_round"]) == len(roof["peak_macs_per_s_by_round"]) == 24
        rows = sorted((row for row in report["results"] if row["engine"] == engine), key=lambda row: row["tokens"])
        assert 0 < rows[0]["roof_ms"] <= rows[1]["roof_ms"]
        for row in rows:
            low, high = row["paired_roof_interval"]
            assert 0 < low <= row["paired_ratio_to_roof"] <= high
    assert report["config"]["cost_context"] == 16 and len(report["config"]["question_ids"]) == 2
    assert (tmp_path / "cost.png").exists()


@pytest.mark.e2e
def test_bench_without_in_process_rows_compares_the_services_alone(bench_files):
    """--no-in-process: no transformers rows (a large verifier's float32 generate() takes minutes),
    the service rows and their ratios to the verifier alone as usual."""
    common, tmp_path = bench_files
    out = tmp_path / "services.json"
    assert main(["bench", *common, "--no-in-process", "--max-new-tokens", "6", "--budgets", "2", "--trees", "chain",
                 "--out", str(out)]) == 0
    rows = {row["name"]: row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {"autoregressive", "chain_b2"}
    assert rows["chain_b2"]["vs_hf_assisted"] is None and rows["chain_b2"]["greedy_matches_verifier_alone"] == 1.0
    assert rows["chain_b2"]["across_tokenizers"] is None  # the tiny pair shares its tokenizer


def test_humaneval_prompts_are_its_problems_as_completions():
    from specdec.core.prompts import evaluation_split, load_prompts

    rows = load_prompts("humaneval")
    assert [r["question_id"] for r in rows] == list(range(164))
    held_out = evaluation_split(rows, 3)
    assert [r["question_id"] for r in held_out] == [0, 4, 8]
    assert "def has_close_elements(" in held_out[0]["prompt"] and held_out[0]["prompt"].startswith("Complete the following Python")


def test_code_edit_prompts_hold_the_reference_function_to_rewrite():
    from specdec.core.prompts import evaluation_split, load_prompts

    completions, edits = evaluation_split(load_prompts("humaneval"), 2), evaluation_split(load_prompts("code-edit"), 2)
    assert [r["question_id"] for r in edits] == [0, 4] and {r["category"] for r in edits} == {"code-edit"}
    assert edits[0]["prompt"].startswith("Rewrite the following Python function")
    # the whole function: the completion prompt's signature and docstring, then the reference body
    assert "def has_close_elements(" in edits[0]["prompt"] and "return False" in edits[0]["prompt"]
    assert "return False" not in completions[0]["prompt"]


def test_fresh_completion_prompts_ask_for_the_body_alone():
    from specdec.core.prompts import evaluation_split, load_prompts

    fresh = evaluation_split(load_prompts("humaneval-fresh"), 2)
    assert [r["question_id"] for r in fresh] == [0, 4] and {r["category"] for r in fresh} == {"humaneval-fresh"}
    assert fresh[0]["prompt"].startswith("Complete this Python function. Reply with code only: the lines of its body")
    assert "def has_close_elements(" in fresh[0]["prompt"] and "return False" not in fresh[0]["prompt"]


def test_a_drafters_entry_names_its_draft_vocabulary_and_format():
    """--drafters NAME@N@FORMAT: the stack's drafter section (a block format quantizes a GGUF again)."""
    import dataclasses

    from specdec.bench.speed import _drafter_args
    from specdec.core.models import ModelSpec
    from specdec.serving.config import config_from_dict

    config = config_from_dict({"drafter": {"model": {"source": "smollm2-135m-drafter", "dtype": "int8"}}})
    model = _drafter_args("model@4096@q4_0", config, True, None, None)["model"]
    assert (model["source"], model["draft_vocab"], model["dtype"], model["requantize"]) == ("smollm2-135m-drafter", 4096, "q4_0", True)
    model = _drafter_args("model@0", config, True, None, None)["model"]
    assert (model["draft_vocab"], model["dtype"], model["requantize"]) == (0, "int8", False)
    assert _drafter_args("model@int8", config, True, None, None)["model"]["requantize"] is False
    # Another drafter than the config's takes none of its model's settings: a suffix stack beside a 0.5B with a cut head.
    config = config_from_dict({"drafter": {"model": {"source": "smollm2-135m-drafter", "draft_vocab": 4096}}})
    assert _drafter_args("suffix", config, True, None, None)["model"] == dataclasses.asdict(ModelSpec("suffix"))
    config_from_dict({"drafter": _drafter_args("suffix", config, True, None, None)})  # a valid drafter section
