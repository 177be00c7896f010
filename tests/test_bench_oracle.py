"""The bench's oracle drafter (the verifier alone's own continuation, recorded through the stack)
and the round anatomy every request reports, through the real services."""
from __future__ import annotations

import pytest

from specdec.core.oracle import ORACLE, ReferenceTable, write_references
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.config import ConfigError, config_from_dict
from specdec.v1 import common_pb2
from tests.conftest import local_stack, tiny_config

PROMPTS = [[1, 5, 6, 7], [1, 9, 3, 4, 8, 10]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def oracle_stack(tiny_dirs, tmp_path_factory):
    """A stack whose drafter is the oracle, with the references recorded as the bench records
    them: the table is empty while the stack starts, then filled from the verifier alone
    through the same stack. Yields the client and the verifier alone's outputs."""
    references = tmp_path_factory.mktemp("oracle")
    write_references(references, [])
    config = tiny_config(tiny_dirs)
    config["drafter"] = {"model": str(references)}
    with local_stack(config) as stack:
        client = CoordinatorClient(stack["coordinator"])
        alone = [
            list(client.generate(generate_request(prompt_token_ids=ids, max_new_tokens=NEW_TOKENS, num_draft_tokens=0)).token_ids)
            for ids in PROMPTS
        ]
        write_references(references, list(zip(PROMPTS, alone)))
        yield client, alone
        client.close()


@pytest.mark.parametrize("method", ["chain", "dynamic"])
@pytest.mark.parametrize("budget", [2, 4])
def test_oracle_keeps_every_draft_token_and_gives_the_verifier_alone_output(oracle_stack, method, budget):
    client, alone = oracle_stack
    for ids, reference in zip(PROMPTS, alone):
        response = client.generate(generate_request(
            prompt_token_ids=ids, max_new_tokens=NEW_TOKENS, num_draft_tokens=budget, tree=common_pb2.TreeShape(method=method),
        ))
        stats = response.stats
        assert list(response.token_ids) == reference
        # A chain of the plan's depth, cut only where fewer tokens are left: every token is kept.
        assert stats.drafted_tokens > 0 and stats.accepted_draft_tokens == stats.drafted_tokens
        rounds_needed = -(-len(reference) // (budget + 1))  # ceil: each round keeps its draft and the verifier's token
        assert stats.speculative_rounds <= rounds_needed + 1  # + 1: the verifier alone may take a round at the end


def test_oracle_is_exact_when_sampling_and_drafting_ahead(oracle_stack):
    """Sampled: its point-mass drafts are verified exactly, and once a sampled token leaves the
    reference it drafts nothing. Overlapped: its pick is the reference's next token."""
    client, alone = oracle_stack
    sampled = client.generate(
        generate_request(prompt_token_ids=PROMPTS[0], max_new_tokens=NEW_TOKENS, num_draft_tokens=3, temperature=1.0, seed=3)
    )
    assert len(sampled.token_ids) == NEW_TOKENS or sampled.finish_reason == "stop"
    ahead = client.generate(generate_request(prompt_token_ids=PROMPTS[1], max_new_tokens=NEW_TOKENS, num_draft_tokens=3, overlap=True))
    assert list(ahead.token_ids) == alone[1]
    assert ahead.stats.overlap_hits > 0


def test_reference_table_matches_a_context_by_its_whole_prompt(tmp_path):
    write_references(tmp_path, [([1, 2], [7, 8]), ([1, 2, 3], [9])])
    table = ReferenceTable(str(tmp_path))
    assert table.find([1, 2]) == [1, 2, 7, 8]
    assert table.find([1, 2, 3]) == [1, 2, 3, 9]  # not the first prompt's: 3 is not its continuation
    assert table.find([1, 2, 7]) == [1, 2, 7, 8]
    assert table.find([4]) is None
    write_references(tmp_path, [([4], [5])])  # recorded after the drafter started: read on a miss
    assert table.find([4]) == [4, 5]


def test_the_oracle_is_a_benchmark_drafter_that_serve_refuses(tmp_path, capsys):
    from specdec.cli import main

    with pytest.raises(ConfigError, match="benchmark drafter"):
        config_from_dict({"drafter": {"model": ORACLE}})
    write_references(tmp_path / "table", [([1], [2])])
    config = tmp_path / "oracle.yaml"
    config.write_text(f"drafter:\n  model: {tmp_path / 'table'}\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "the oracle drafter is a benchmark drafter" in capsys.readouterr().err


def test_round_anatomy_adds_up(tiny_dirs):
    """Means per round of each part: the round holds both services' compute, its overhead is the
    rest, made of both hops and the coordinator's own time. A request's first round, which
    reads the prompt, is left out."""
    with local_stack(tiny_config(tiny_dirs)) as stack:
        client = CoordinatorClient(stack["coordinator"])
        speculative = client.generate(generate_request(prompt_token_ids=PROMPTS[0], max_new_tokens=NEW_TOKENS, num_draft_tokens=3)).stats
        alone = client.generate(generate_request(prompt_token_ids=PROMPTS[0], max_new_tokens=NEW_TOKENS, num_draft_tokens=0)).stats
        client.close()
    for stats, anatomy, rounds in (
        (speculative, speculative.speculative_anatomy, speculative.speculative_rounds),
        (alone, alone.verifier_alone_anatomy, alone.rounds),
    ):
        assert 0 < anatomy.rounds < rounds
        compute = anatomy.draft_compute_ms + anatomy.verify_compute_ms
        assert anatomy.round_ms >= compute
        assert anatomy.overhead_ms == pytest.approx(anatomy.round_ms - compute)
        assert anatomy.overhead_ms == pytest.approx(anatomy.draft_hop_ms + anatomy.verify_hop_ms + anatomy.coordinator_ms)
        assert anatomy.verify_hop_ms > 0 and anatomy.verify_request_bytes > 0 and anatomy.verify_response_bytes > 0
        assert 0 < anatomy.verify_in_service_ms <= anatomy.verify_hop_ms  # the handler's own work is part of the hop
        assert anatomy.round_ms * anatomy.rounds <= stats.total_ms
    anatomy = speculative.speculative_anatomy
    assert anatomy.draft_compute_ms > 0 and anatomy.draft_hop_ms > 0 and anatomy.draft_request_bytes > 0
    assert 0 < anatomy.draft_in_service_ms <= anatomy.draft_hop_ms
    assert alone.verifier_alone_anatomy.draft_hop_ms == 0 and not alone.speculative_anatomy.rounds


def test_bench_rows_carry_the_anatomy_with_each_hop_beside_its_loopback_floor(tmp_path):
    from specdec.bench.speed import Tally, add_hop_floors, format_anatomy, plot_anatomy
    from specdec.v1 import coordinator_pb2

    def response(rounds: int, round_ms: float, draft_bytes: float) -> coordinator_pb2.GenerateResponse:
        anatomy = coordinator_pb2.RoundAnatomy(
            rounds=rounds, round_ms=round_ms, draft_compute_ms=2.0, verify_compute_ms=6.0, draft_hop_ms=1.0, verify_hop_ms=1.5,
            coordinator_ms=round_ms - 10.5, overhead_ms=round_ms - 8.0, draft_request_bytes=draft_bytes, draft_response_bytes=60,
            verify_request_bytes=80, verify_response_bytes=40,
        )
        return coordinator_pb2.GenerateResponse(token_ids=[1] * 8, stats=coordinator_pb2.RoundStats(speculative_anatomy=anatomy))

    tally = Tally()
    tally.add_service(response(3, 12.0, 100), 0.1)
    tally.add_service(response(1, 16.0, 300), 0.1)
    row = {"name": "chain_b4", "method": "speculative", "drafter": "model", "tree": "chain", "budget": 4, "temperature": 0.0,
           "round_anatomy": tally.round_anatomy()}
    add_hop_floors([row])
    anatomy = row["round_anatomy"]["speculative"]
    assert row["round_anatomy"]["verifier_alone"] is None
    assert anatomy["rounds"] == 4 and anatomy["round_ms"] == pytest.approx(13.0)  # weighted by rounds
    assert anatomy["overhead_ms"] == pytest.approx(anatomy["round_ms"] - 8.0)
    assert anatomy["draft_payload_bytes"] == [200, 60] and anatomy["verify_payload_bytes"] == [80, 40]  # medians over requests
    assert 0 < anatomy["draft_hop_floor_ms"] and 0 < anatomy["verify_hop_floor_ms"]
    assert "chain" in format_anatomy([row])
    plot_anatomy([row], tmp_path / "anatomy.png")
    assert (tmp_path / "anatomy.png").stat().st_size > 0
