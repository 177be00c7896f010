"""Structured outputs under speculation: the grammar core on the Qwen2.5 tokenizer, exact
constrained verification (greedy against the constrained verifier alone for every plan,
sampling against the exact constrained distribution), the coordinator's forced tokens and
pruning, bad constraints refused, and OpenAI's response_format through the real client."""
from __future__ import annotations

import json
from pathlib import Path

import grpc
import jsonschema
import openai
import pydantic
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from coordinator.openai_api import OpenAIFrontend, openai_app
from coordinator.server import CoordinatorServicer
from specdec.core.grammar import (
    Constraint,
    ConstraintError,
    Grammars,
    below_forced,
    constrain_draft,
    mask_tree_rows,
    prune_tree,
)
from specdec.core.models import ModelSpec
from specdec.core.sampling import Sampling
from specdec.core.tree import ROOT, DraftTree, Proposal, TreeShape
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.v1 import common_pb2
from tests.conftest import local_stack
from tests.stats import assert_matches_distribution
from tests.tiny_models import build_text_model_dir, qwen_tokenizer_dir
from verifier_service.verifier import Verifier

# The tiny models prefer these texts' tokens: compact JSON of the schema below, so that
# greedy outputs complete it within a few dozen tokens.
TEXTS = ['{"name":"add","count":2,"ok":true}', '{"name":"sub","count":17,"ok":false}', "yes no maybe"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "count", "ok"],
    "additionalProperties": False,
}
PROMPT = "Describe the function add as JSON:"


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("structured")
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir(root / "tokenizer"))
    return {
        "tokenizer": tokenizer,
        "verifier": build_text_model_dir(root / "verifier", tokenizer, TEXTS, seed=1, arch="qwen2"),
        "drafter": build_text_model_dir(root / "drafter", tokenizer, TEXTS, seed=2, arch="qwen2"),
    }


@pytest.fixture(scope="module")
def grammars(qwen_pair) -> Grammars:
    tokenizer = qwen_pair["tokenizer"]
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], max_bytes=4096)


@pytest.fixture(scope="module")
def stack(qwen_pair):
    config = {
        "verifier": {"model": str(qwen_pair["verifier"]), "torch_threads": 1},
        "drafter": {"model": str(qwen_pair["drafter"]), "torch_threads": 1},
        "coordinator": {"num_draft_tokens": 4, "adaptive": {"enabled": False}},
        "limits": {"max_constraint_bytes": 4096},
    }
    with local_stack(config) as running:
        client = CoordinatorClient(running["coordinator"])
        yield running | {"client": client}
        client.close()


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


# --- the grammar core -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "constraint, words",
    [
        (Constraint("json_schema", "{not json"), "not valid JSON"),
        (Constraint("json_schema", "[1, 2]"), "must be a JSON object"),
        (Constraint("json_schema", '{"type": "objec"}'), "does not compile"),
        (Constraint("regex", "[a-z"), "unclosed character class"),
        (Constraint("grammar", "start: undefined_rule"), "unknown name"),
        (Constraint("choice", "[]"), "at least one non-empty string"),
        (Constraint("regex", "a" * 5000), "at most 4096"),
    ],
)
def test_bad_constraints_say_what_is_wrong(grammars, constraint, words):
    with pytest.raises(ConstraintError, match=words):
        grammars.state(constraint)


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_state(grammars, qwen_pair):
    tokenizer = qwen_pair["tokenizer"]
    constraint = Constraint("regex", "(cat|dog)s? [0-9]{2}")
    first, compile_ms = grammars.state(constraint)
    second, again_ms = grammars.state(constraint)
    assert compile_ms > 0 and again_ms == 0.0
    assert first.advance(tokenizer.encode("dogs", add_special_tokens=False))
    assert not second.copy().advance(tokenizer.encode("s", add_special_tokens=False))  # the other state is still at the start
    assert bool(second.allowed()[tokenizer.encode("cat", add_special_tokens=False)[0]])


def test_forced_tokens_spell_what_the_grammar_leaves_no_choice_about(grammars, qwen_pair):
    tokenizer = qwen_pair["tokenizer"]
    state, _ = grammars.state(Constraint("choice", json.dumps(["serialize_to_json", "parse"])))
    assert state.forced(32) == []  # two ways on
    assert state.advance(tokenizer.encode("serial", add_special_tokens=False))
    forced = state.forced(32)
    assert forced and _decode(tokenizer, forced) == "ize_to_json"[: len(_decode(tokenizer, forced))]
    assert state.advance(forced) and state.forced(2) == state.forced(32)[:2]


def test_each_tree_row_is_masked_by_its_own_path(grammars, qwen_pair):
    tokenizer = qwen_pair["tokenizer"]
    ids = {word: tokenizer.encode(word, add_special_tokens=False)[0] for word in ("cat", "dog", "s", " ", "x")}
    state, _ = grammars.state(Constraint("regex", "(cat|dog)s? [0-9]"))
    # cat, dog, x (forbidden); cat -> s, cat -> " "; x -> s (below a forbidden node)
    tree = DraftTree([ids["cat"], ids["dog"], ids["x"], ids["s"], ids[" "], ids["s"]], [ROOT, ROOT, ROOT, 0, 0, 2])
    logits = torch.randn(len(tree) + 1, len(tokenizer))
    masked = mask_tree_rows(logits, tree, state)
    for row, path in ((0, []), (1, [0]), (2, [1]), (4, [0, 3]), (5, [0, 4])):
        expected = state.copy()
        assert expected.advance([tree.token_ids[n] for n in path])
        allowed = expected.allowed()
        assert torch.isinf(masked[row][~allowed]).all() and torch.equal(masked[row][allowed], logits[row][allowed])
    for row in (3, 6):  # paths the grammar forbids: never read, left as they were
        assert torch.equal(masked[row], logits[row])


def test_pruning_drops_forbidden_paths_but_keeps_sampled_siblings_for_the_residual(grammars, qwen_pair):
    tokenizer = qwen_pair["tokenizer"]
    cat, dog, x, s = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("cat", "dog", "x", "s"))
    state, _ = grammars.state(Constraint("regex", "(cat|dog)s?"))
    point_mass = DraftTree([cat, x, s, s], [ROOT, ROOT, 0, 1])
    assert prune_tree(point_mass, state)[0] == [0, 2]  # x and its child go
    sampled = DraftTree([x, dog, s], [ROOT, ROOT, 0], {ROOT: Proposal([x, dog], [0.5, 0.5])})
    assert prune_tree(sampled, state)[0] == [0, 1]  # x stays as a leaf: its rejection moves the residual
    chained = below_forced([7, 8], DraftTree([1, 2], [ROOT, 0], {ROOT: Proposal([1], [1.0])}))
    assert chained.token_ids == [7, 8, 1, 2] and chained.parent == [ROOT, 0, 1, 2] and set(chained.proposals) == {1}


def test_a_constrained_draft_starts_with_the_forced_tokens_and_goes_on_through_structure(grammars, qwen_pair):
    tokenizer = qwen_pair["tokenizer"]

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    state, _ = grammars.state(Constraint("regex", r'name: "[a-z]+", size: [0-9]+'))
    forced = state.forced(32)
    assert tokenizer.decode(forced) == "name:"  # not the quote: a longer token may start with it
    chain = ids(' "cat"')
    draft = DraftTree(chain + ids("x"), list(range(-1, len(chain) - 1)) + [ROOT])  # the chain, and a forbidden branch
    made = constrain_draft(draft, state, forced, max_depth=32)
    assert made.kept == list(range(len(chain)))
    text = tokenizer.decode(made.tree.token_ids)  # the forced text, the draft, then what the grammar forces after it
    assert text.startswith('name: "cat", size') and made.tail > 0
    assert made.tree.parent == list(range(-1, len(made.tree) - 1))  # one chain
    assert made.forced == set(range(len(forced))) | set(range(len(forced) + len(chain), len(made.tree)))
    shallow = constrain_draft(draft, state, forced, max_depth=len(forced) + len(chain) + 1)  # room for one more token
    assert shallow.tail == 1 and len(shallow.tree) == len(forced) + len(chain) + 1


def test_a_model_drafter_masks_its_proposals_by_the_constraint(qwen_pair, grammars):
    """Greedy and sampled drafts of every tree shape: each node's path allowed by the grammar, so
    the coordinator prunes nothing; the same drafter unconstrained proposes tokens it forbids."""
    from drafter_service.selection import drafter_for

    tokenizer = qwen_pair["tokenizer"]
    sessions = drafter_for(ModelSpec(str(qwen_pair["drafter"])))
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    shapes = [TreeShape("chain"), TreeShape("dynamic", width=3), TreeShape("rsd-s", width=2), TreeShape("static", branching=[2, 2])]
    unconstrained_broke = False
    for n, (shape, sampling) in enumerate((s, t) for s in shapes for t in (Sampling(), Sampling(temperature=1.0, seed=4))):
        for constrained in (True, False):
            name = f"{n}-{constrained}"
            session = sessions.open_session(name, prompt, sampling, "", constraint if constrained else None)
            draft = sessions.draft(
                session_id=name, session=session, new_tokens=[], committed_length=len(prompt), num_tokens=8, shape=shape
            )
            state, _ = grammars.state(constraint)
            kept, _ = prune_tree(draft.tree, state)
            if constrained:
                assert len(draft.tree) and kept == list(range(len(draft.tree))), shape
            else:
                unconstrained_broke |= len(kept) < len(draft.tree)
            sessions.end_session(name)
    assert unconstrained_broke


# --- exact verification ---------------------------------------------------------------------


def test_constrained_sampling_follows_the_constrained_distribution(qwen_pair):
    """The first token of a round whose tree was drawn, without replacement, from a proposal that
    puts mass on tokens the grammar forbids, pruned as the coordinator prunes: its distribution
    is the verifier's softmax (temperature 1) renormalised on the tokens the grammar allows
    ("a" and "ax" alike). Power: over 3,000 draws a TVD of ~0.03 is caught half the time
    (tests/stats.py detectable_tvd)."""
    tokenizer = qwen_pair["tokenizer"]
    verifier = Verifier(ModelSpec(str(qwen_pair["verifier"])))
    constraint = Constraint("regex", "[a-f]x")
    letters = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "abcdef"]
    forbidden = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "uvw"]
    prompt = tokenizer.encode("Pick a letter:", add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(qwen_pair["verifier"], dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    allowed = torch.nonzero(verifier.grammar_state(constraint, []).allowed()[: len(logits)]).flatten()
    assert set(letters) <= set(allowed.tolist()) and not set(forbidden) & set(allowed.tolist())
    exact = torch.softmax(logits[allowed], -1)
    candidates = forbidden + letters[:3]
    proposal = Proposal(candidates, [1.0 / len(candidates)] * len(candidates))
    rng = torch.Generator().manual_seed(5)
    counts = torch.zeros(len(allowed))
    for draw in range(3000):
        order = torch.randperm(len(candidates), generator=rng)[:4].tolist()  # uniform q: any order is a draw without replacement
        tree = DraftTree([candidates[i] for i in order], [ROOT] * 4, {ROOT: proposal})
        session = verifier.open_session(f"s{draw}", prompt, Sampling(temperature=1.0, seed=draw), constraint=constraint)
        kept, _ = prune_tree(tree, verifier.grammar_state(constraint, []))
        result = verifier.verify(session, 1, tree.subtree(kept), 0)
        counts[allowed.tolist().index(result.token_ids[0])] += 1
        verifier.sessions.pop(f"s{draw}")
    assert_matches_distribution(counts, exact)


# --- through the services -------------------------------------------------------------------

PLANS = [
    {"num_draft_tokens": 0},
    {"num_draft_tokens": 4},
    {"num_draft_tokens": 8, "tree": common_pb2.TreeShape(method="dynamic", width=3)},
    {"num_draft_tokens": 8, "tree": common_pb2.TreeShape(method="rsd-s", width=2)},
    {"num_draft_tokens": 6, "tree": common_pb2.TreeShape(method="static", branching=[2, 2])},
    {"num_draft_tokens": 4, "overlap": True},
    {"adaptive": True},
]


def _ask(stack, constraint: common_pb2.Constraint, **fields):
    request = generate_request(PROMPT, max_new_tokens=fields.pop("max_new_tokens", 48), **fields)
    request.constraint.CopyFrom(constraint)
    return stack["client"].generate(request)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_plan_answers_what_the_constrained_verifier_alone_answers(stack, temperature):
    constraint = common_pb2.Constraint(json_schema=json.dumps(SCHEMA))
    answers = [_ask(stack, constraint, temperature=temperature, seed=3, **plan) for plan in PLANS]
    alone = answers[0]
    assert alone.finish_reason == "stop", alone.text
    jsonschema.validate(json.loads(alone.text), SCHEMA)
    if temperature == 0:  # sampled plans draw their own randomness: each valid, not equal
        for plan, answer in zip(PLANS, answers):
            assert list(answer.token_ids) == list(alone.token_ids), plan
    for answer in answers:
        if answer.finish_reason == "stop":
            jsonschema.validate(json.loads(answer.text), SCHEMA)
    speculative = [a.stats for a in answers[1:] if a.stats.drafted_tokens]
    assert speculative and all(s.grammar_mask_ms > 0 for s in speculative)


def test_regex_grammar_and_choice_outputs_match_and_forced_tokens_are_drafted_for_free(stack):
    cases = [
        (common_pb2.Constraint(regex="(yes|no|maybe)-[0-9]{2}"), r"(yes|no|maybe)-[0-9]{2}"),
        (common_pb2.Constraint(grammar='start: "answer: " WORD\nWORD: /[a-z]{1,6}/'), r"answer: [a-z]{1,6}"),
        (common_pb2.Constraint(choice=common_pb2.Choices(options=["serialize_to_json", "parse"])), r"serialize_to_json|parse"),
    ]
    import re

    for constraint, pattern in cases:
        alone = _ask(stack, constraint, num_draft_tokens=0)
        drafted = _ask(stack, constraint, num_draft_tokens=4)
        assert alone.finish_reason == drafted.finish_reason == "stop"
        assert re.fullmatch(pattern, alone.text) and drafted.text == alone.text
    sentence = common_pb2.Constraint(regex="The answer is: (yes|no)")
    forced = _ask(stack, sentence, num_draft_tokens=4)
    assert forced.text in ("The answer is: yes", "The answer is: no")
    assert forced.stats.forced_tokens >= 4 and forced.stats.accepted_forced_tokens >= 4
    assert forced.stats.rounds <= 3  # the forced text verified in one round, not one round a token
    alone = _ask(stack, sentence, num_draft_tokens=0)  # the verifier alone: nothing drafted, not even forced tokens
    assert alone.text == forced.text and alone.stats.forced_tokens == 0


def test_fused_generation_verifies_forced_tokens_as_it_goes(qwen_pair):
    """The verifier's fused generation with forced drafts gives the tokens of one-token steps,
    in fewer passes; each call ends after a pass that kept forced tokens (a drafter may copy
    what follows)."""
    tokenizer = qwen_pair["tokenizer"]
    verifier = Verifier(ModelSpec(str(qwen_pair["verifier"])))
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    session = verifier.open_session("plain", prompt, Sampling(), constraint=constraint)
    plain = verifier.verify(session, 1, DraftTree(), 40)
    assert plain.forced_drafted == 0
    session = verifier.open_session("forced", prompt, Sampling(), constraint=constraint)
    tokens, kept, calls = [], 0, 0
    while len(tokens) < len(plain.token_ids):
        calls += 1
        result = verifier.verify(session, calls, DraftTree(), 40 - len(tokens), forced_drafts=True)
        tokens += result.token_ids
        kept += result.forced_accepted
        assert result.forced_accepted <= result.forced_drafted
    assert tokens == plain.token_ids and kept >= 8 and calls > 1
    jsonschema.validate(json.loads(tokenizer.decode(plain.token_ids, skip_special_tokens=True)), SCHEMA)


def test_bad_constraints_are_refused_and_the_stack_keeps_serving(stack):
    bad = [
        (common_pb2.Constraint(json_schema="{oops"), "constraint: json_schema is not valid JSON"),
        (common_pb2.Constraint(regex="(unclosed"), "constraint: regex does not compile"),
        (common_pb2.Constraint(grammar="start: missing"), "constraint: grammar does not compile"),
        (common_pb2.Constraint(choice=common_pb2.Choices()), "constraint: choice must list"),
        (common_pb2.Constraint(regex="a" * 5000), "at most 4096"),
    ]
    for constraint, words in bad:
        with pytest.raises(grpc.RpcError) as caught:
            _ask(stack, constraint)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in caught.value.details()
    assert _ask(stack, common_pb2.Constraint(regex="(yes|no)")).finish_reason == "stop"


# --- OpenAI's response_format -----------------------------------------------------------------


@pytest.fixture(scope="module")
def api(stack):
    app = openai_app(OpenAIFrontend(CoordinatorServicer(stack["coordinator_obj"]), "tiny", set()))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0), http


class Description(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str = pydantic.Field(max_length=10)
    count: int = pydantic.Field(ge=0, le=99)
    ok: bool


def test_openai_response_format_and_the_parse_helper(api, stack):
    client, _ = api
    messages = [{"role": "user", "content": PROMPT}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "description", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=48, temperature=0, response_format=schema_format)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=48, temperature=0, response_format=schema_format, stream=True,
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    parsed = client.chat.completions.parse(model="tiny", messages=messages, max_tokens=48, temperature=0, response_format=Description)
    assert isinstance(parsed.choices[0].message.parsed, Description)
    anything = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=64, temperature=0, extra_body={"response_format": {"type": "json_object"}}
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].text), dict)
    choice = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body, words",
    [
        ({"response_format": {"type": "json_schema"}}, "needs its json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "set one of"),
        ({"structured_outputs": {"regex": "(a"}}, "regex does not compile"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}}, "json_schema does not compile"),
    ],
)
def test_bad_structured_requests_get_openai_errors(api, body, words):
    _, http = api
    answer = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4} | body)
    assert answer.status_code == 400 and words in answer.json()["error"]["message"]
