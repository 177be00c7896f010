"""The committed generated gRPC code is current, and configuration errors are clear."""
from __future__ import annotations

import argparse
import filecmp
from pathlib import Path

import pytest

from specdec.cli import _app_args, main
from specdec.serving.cli_args import (
    add_policy_arguments,
    add_serve_steering_arguments,
    add_tree_arguments,
    tree_overrides,
)
from specdec.serving.config import ConfigError, config_from_dict, load_config
from specdec.serving.protos import REPO_ROOT, generate


def test_generated_code_is_current(tmp_path):
    generate(tmp_path)
    fresh = sorted(p.name for p in (tmp_path / "specdec" / "v1").iterdir())
    committed = REPO_ROOT / "specdec" / "v1"
    assert fresh == sorted(p.name for p in committed.iterdir() if p.suffix in (".py", ".pyi"))
    stale = [name for name in fresh if not filecmp.cmp(tmp_path / "specdec" / "v1" / name, committed / name, shallow=False)]
    assert not stale, f"run `python -m specdec.serving.protos`: {stale} differ from protos/"


def test_default_config_is_the_builtin_pair():
    config = load_config(None)
    assert config.verifier.model.source == "smollm2-135m-instruct"
    assert config.coordinator.port == 50051


@pytest.mark.parametrize(
    "data,phrase",
    [
        ({"verifer": {}}, "unknown key verifer"),
        ({"drafter": {"model": {"sorce": "x"}}}, "unknown key drafter.model.sorce"),
        ({"coordinator": {"port": "fast"}}, "coordinator.port must be a valid integer"),
        ({"coordinator": {"port": 70000}}, "coordinator.port must be less than or equal to 65535"),
        ({"coordinator": {"num_draft_tokens": -1}}, "num_draft_tokens"),
        ({"coordinator": {"default_max_new_tokens": 5000}}, "default_max_new_tokens"),
        ({"verifier": {"model": {"dtype": "int4"}}}, "verifier.model.dtype must be one of float32"),
        ({"verifier": {"model": {"dtype": "int8", "device": "cuda"}}}, "verifier.model.dtype int8 runs on the CPU"),
        ({"drafter": {"model": {"layers": 0}}}, "drafter.model.layers"),
        ({"drafter": {"ray_actor_options": 3}}, "drafter.ray_actor_options must be a mapping"),
        ({"verifier": {"model": 12}}, "verifier.model must be a mapping"),
        ({"coordinator": {"tree": {"method": "beam"}}}, "coordinator.tree: method must be one of chain, static"),
        ({"coordinator": {"tree": {"branching": [2, 0]}}}, "coordinator.tree: branching"),
        ({"coordinator": {"tree": {"width": 0}}}, "coordinator.tree: width"),
        ({"coordinator": {"tree": {"depth": 3}}}, "unknown key coordinator.tree.depth"),
        ({"limits": {"max_sessions": 0}}, "limits.max_sessions must be greater than 0"),
        ({"coordinator": {"request_timeout_s": 0}}, "coordinator.request_timeout_s must be greater than 0"),
        ({"limits": {"max_kv_mib": 100.0}}, "limits.max_session_kv_mib must be <= limits.max_kv_mib"),
        ({"limits": {"max_draft_tokens": 40}, "coordinator": {"tree": {"width": 41}}}, r"coordinator.tree: width must be in \[1, 40\]"),
        ({"limits": {"max_draft_tokens": 20}}, r"adaptive budgets must be in \[1, 20\]"),  # the default tree budgets reach 32
        ({"limits": {"max_draft_tokens": 2}}, "coordinator.num_draft_tokens must be in"),  # the default budget is 4
        ({"limits": {"max_fused_tokens": 4}}, "fused_block_tokens must be <= limits.max_fused_tokens"),
        ({"coordinator": {"max_concurrent_requests": 4}}, "unknown key coordinator.max_concurrent_requests"),  # it is in limits
        (
            {"coordinator": {"verifier_in_process": True, "network": {"verifier": {"rtt_ms": 5}}}},
            "coordinator.network.verifier emulates a link to a verifier",
        ),
        ({"coordinator": {"tls": {"cert_file": "s.pem"}}}, "coordinator.tls: needs both cert_file and key_file"),
        ({"coordinator": {"service_tls": {"cert_file": "s.pem"}}}, "coordinator.service_tls: needs both cert_file and key_file"),
        ({"coordinator": {"service_tls": {"cert_file": "s.pem", "key_file": "s.key"}}}, "coordinator.service_tls: needs ca_file"),
        (
            {"coordinator": {"service_tls": {"ca_file": "ca.pem"}}},
            "coordinator.service_tls: sets client certificates, server_name or ca_file without",
        ),
        (
            {"coordinator": {"service_tls": {"cert_file": "s", "key_file": "k", "ca_file": "c", "client_cert_file": "x"}}},
            "needs both client_cert_file and client_key_file",
        ),
    ],
)
def test_config_errors_name_the_key(data, phrase):
    with pytest.raises(ConfigError, match=phrase):
        config_from_dict(data)


def test_yaml_file_loading(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("coordinator:\n  num_draft_tokens: 6\ndrafter:\n  model: some/model\n")
    config = load_config(path)
    assert config.coordinator.num_draft_tokens == 6
    assert config.drafter.model.source == "some/model" and config.drafter.model.layers is None
    path.write_text("coordinator: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_tree_settings_from_yaml_and_cli(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text("coordinator:\n  tree: {method: rsd-c, branching: [3, 2], width: 2, max_depth: 5}\n")
    tree = load_config(path).coordinator.tree
    assert (tree.method, tree.branching, tree.width, tree.max_depth) == ("rsd-c", [3, 2], 2, 5)

    parser = argparse.ArgumentParser()
    add_tree_arguments(parser)
    args = parser.parse_args(["--tree", "dynamic", "--tree-width", "3", "--tree-depth", "6", "--tree-branching", "4,1"])
    assert tree_overrides(args) == {"method": "dynamic", "branching": [4, 1], "width": 3, "max_depth": 6}
    assert config_from_dict({"coordinator": {"tree": tree_overrides(args)}}).coordinator.tree.width == 3
    assert main(["generate", "hi", "--tree-width", "3"]) == 2  # a shape flag without --tree


def test_serve_flags_become_coordinator_settings():
    parser = argparse.ArgumentParser()
    for flag in ("--port", "--num-draft-tokens"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--config")
    add_tree_arguments(parser)
    add_policy_arguments(parser)
    add_serve_steering_arguments(parser)
    args = parser.parse_args(["--port", "5", "--num-draft-tokens", "16", "--tree", "rsd-s", "--adaptive", "--no-overlap"])
    coordinator = config_from_dict(_app_args(args)).coordinator
    assert (coordinator.port, coordinator.num_draft_tokens, coordinator.tree.method) == (5, 16, "rsd-s")
    assert coordinator.adaptive.enabled is True and coordinator.overlap is False and coordinator.steering is True
    config = config_from_dict(_app_args(parser.parse_args(["--port", "5", "--no-steering", "--steering-checkpoint", "ckpt"])))
    assert config.coordinator.steering is False and config.resolved_steering_checkpoint() == "ckpt"
    assert config.coordinator.adaptive.enabled  # the default: the controller picks the plan
    # A server told its plan runs it for requests that name none.
    for flags in (["--num-draft-tokens", "8"], ["--tree", "chain"]):
        assert config_from_dict(_app_args(parser.parse_args(["--port", "5", *flags]))).coordinator.adaptive.enabled is False


def test_printed_stats_give_an_adaptive_request_its_mean_budget():
    """A fixed plan's budget is the request's; an adaptive request's changes by the round."""
    from specdec.serving.client import format_stats
    from specdec.v1 import coordinator_pb2

    stats = coordinator_pb2.RoundStats(
        policy="adaptive", mean_budget=1.25, speculation_budget=4, rounds=8, plan_rounds={"fused": 6, "chain-4": 2}
    )
    assert "8 rounds, mean budget 1.2," in format_stats(stats) and "rounds per plan: chain-4 2, fused 6" in format_stats(stats)
    stats.policy = "fixed"
    assert "8 rounds, budget 4," in format_stats(stats)
