"""Fuzzing the RPCs of the three services (hypothesis, tiny models, real gRPC). Every request is
built either valid or broken in one known field: a valid one must be answered OK, a broken one
refused with the status that fits and a message naming the field, and the services go on
serving. Each way of breaking a request is a test of its own, so that every run tries each.
The examples vary from run to run, from a seed printed with a failure; HYPOTHESIS_PROFILE=ci
repeats the same ones (tests/conftest.py)."""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field
from typing import Callable

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from specdec.core.models import tokenizer_fingerprint
from specdec.core.tree import NGRAM_METHODS, TREE_METHODS
from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.config import LimitsConfig
from specdec.serving.wire import COORDINATOR_SERVICE, DRAFTER_SERVICE, VERIFIER_SERVICE
from specdec.v1 import common_pb2, coordinator_pb2, drafter_pb2, verifier_pb2
from tests.tiny_models import WORDS, build_tokenizer

VOCAB = len(WORDS)  # the tiny models' vocabulary
MAX_CONTEXT = 128  # their max_position_embeddings
FINGERPRINT = tokenizer_fingerprint(build_tokenizer())
LIMITS = LimitsConfig()  # the test stack runs with the default limits
CAP = LIMITS.max_draft_tokens
INT32 = (-(2**31), 2**31 - 1)
UINT32_MAX = 2**32 - 1
TINY = 2.0**-126  # float32's smallest normal number: negatives from -TINY down are no -0.0
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclass(frozen=True)
class Fault:
    """What a request broken in one field must get: `code`, with a message that says `named`."""

    named: str
    code: grpc.StatusCode = INVALID


@dataclass
class Case:
    request: Message
    fault: Fault | None  # None: a valid request


# A breaker turns a valid request into one broken in one field (drawing what it needs) and
# returns the Fault the service must answer with.
Breaker = Callable[[Callable, Message], Fault]


def cases(valid: st.SearchStrategy, breaker: Breaker | None = None) -> st.SearchStrategy[Case]:
    """Requests from `valid`, broken by `breaker` (None: left valid)."""

    @st.composite
    def build(draw) -> Case:
        request = draw(valid)
        return Case(request, breaker and breaker(draw, request))

    return build()


def setting(path: str, values: st.SearchStrategy, named: str | None = None, code: grpc.StatusCode = INVALID) -> Breaker:
    """A breaker setting the field at `path` (dotted) to one of `values`; the answer must name
    the field (its last part) unless `named` says what else."""
    *parents, name = path.split(".")

    def breaker(draw, request: Message) -> Fault:
        holder, value = functools.reduce(getattr, parents, request), draw(values)
        if isinstance(value, list):
            getattr(holder, name)[:] = value
        elif isinstance(value, Message):
            getattr(holder, name).CopyFrom(value)
        else:
            setattr(holder, name, value)
        return Fault(named or name, code)

    return breaker


TOKENS = st.integers(0, VOCAB - 1)
BAD_TOKENS = st.integers(INT32[0], -1) | st.integers(VOCAB, INT32[1])
# Session ids that valid requests use (re-opened by `start` each time) and ids never opened.
SESSION_IDS = st.text(min_size=1, max_size=8)
NEVER_OPENED = st.uuids().map(lambda u: f"never-opened-{u.hex}")
TEMPERATURES = st.floats(0, 3, width=32) | st.sampled_from([TINY, 1e30])  # greedy to near-uniform
BAD_TEMPERATURES = st.floats(max_value=-TINY, width=32) | st.sampled_from([math.nan, math.inf])
TOP_KS = st.integers(0, 2 * VOCAB) | st.just(INT32[1])
BAD_TOP_KS = st.integers(INT32[0], -1)
BAD_TOP_PS = st.floats(min_value=1.0, exclude_min=True, width=32) | st.floats(max_value=-TINY, width=32) | st.just(math.nan)
BAD_SIZES = st.integers(CAP + 1, UINT32_MAX)  # tree width, depth: past any draft's nodes
EMPTY = st.just([])
LONG_CONTEXTS = st.lists(TOKENS, min_size=MAX_CONTEXT, max_size=MAX_CONTEXT + 40)


def spoiled(ids, values: st.SearchStrategy = BAD_TOKENS) -> st.SearchStrategy[list]:
    """`ids` with one entry (a new one, if empty) replaced by one of `values`."""
    ids = list(ids) or [0]
    return st.tuples(st.integers(0, len(ids) - 1), values).map(lambda change: ids[: change[0]] + [change[1]] + ids[change[0] + 1 :])


# --- sessions: Verify and Draft open theirs with `start` -------------------------------------

@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    """Valid sampling: top_p 0 reads as 1."""
    return common_pb2.SamplingParams(
        temperature=draw(TEMPERATURES), top_p=draw(st.floats(0, 1, width=32)), top_k=draw(TOP_KS), seed=draw(st.integers(0, 2**64 - 1))
    )


@st.composite
def session_starts(draw) -> common_pb2.SessionStart:
    context = draw(st.lists(TOKENS, min_size=1, max_size=6))
    return common_pb2.SessionStart(
        context_token_ids=context, sampling=draw(sampling_params()), prompt_length=draw(st.integers(0, len(context)))
    )


def never_opened(draw, request) -> Fault:
    request.ClearField("start")
    request.session_id = draw(NEVER_OPENED)
    return Fault("session", grpc.StatusCode.NOT_FOUND)


def context_fault(contexts: Callable[[list], st.SearchStrategy]) -> Breaker:
    """A breaker replacing the start's context with one of `contexts(the valid one)`."""

    def breaker(draw, request) -> Fault:
        start = request.start
        start.context_token_ids[:] = draw(contexts(start.context_token_ids))
        start.prompt_length = min(start.prompt_length, len(start.context_token_ids))
        return Fault("context_token_ids")

    return breaker


SESSION_FAULTS = {
    "empty-session_id": setting("session_id", st.just("")), "never-opened-session": never_opened,
    "bad-temperature": setting("start.sampling.temperature", BAD_TEMPERATURES), "bad-top_p": setting("start.sampling.top_p", BAD_TOP_PS),
    "bad-top_k": setting("start.sampling.top_k", BAD_TOP_KS),
}
CONTEXT_FAULTS = {
    "empty-context": context_fault(lambda _: EMPTY), "long-context": context_fault(lambda _: LONG_CONTEXTS),
    "context-outside-vocabulary": context_fault(spoiled),
}


# --- Verify --------------------------------------------------------------------------------

@st.composite
def draft_trees(draw) -> common_pb2.DraftTree:
    """Valid trees of 1 to 8 nodes: parents before children; proposals (sampled drafts) for a
    few nodes whose children differ, covering those children."""
    size = draw(st.integers(1, 8))
    tree = common_pb2.DraftTree(
        token_ids=draw(st.lists(TOKENS, min_size=size, max_size=size)), parent=[draw(st.integers(-1, i - 1)) for i in range(size)]
    )
    for node in draw(st.lists(st.integers(-1, size - 1), unique=True, max_size=3)):
        children = [t for t, p in zip(tree.token_ids, tree.parent) if p == node]
        if len(set(children)) == len(children):
            support = sorted(set(children) | set(draw(st.lists(TOKENS, max_size=3)))) or [0]  # never empty
            weights = draw(st.lists(st.integers(1, 9), min_size=len(support), max_size=len(support)))
            tree.expanded_nodes.append(node)
            tree.proposal.add(token_ids=support, probs=[w / sum(weights) for w in weights])
    return tree


@st.composite
def verify_requests(draw) -> verifier_pb2.VerifyRequest:
    """A session's first round: a tree to verify, or verifier-only tokens."""
    request = verifier_pb2.VerifyRequest(session_id=draw(SESSION_IDS), round=1, start=draw(session_starts()))
    if draw(st.booleans()):
        request.tree.CopyFrom(draw(draft_trees()))
    else:
        request.fused_tokens = draw(st.integers(0, LIMITS.max_fused_tokens))
    return request


def tree_fault(change: Callable[[Callable, common_pb2.DraftTree], str], tree: st.SearchStrategy = draft_trees()) -> Breaker:
    """A breaker verifying a tree from `tree` instead of the request's own, broken by `change`,
    which returns the field the answer must name."""

    def breaker(draw, request) -> Fault:
        request.fused_tokens = 0
        request.tree.CopyFrom(draw(tree))
        return Fault(change(draw, request.tree))

    return breaker


def _token_outside(draw, tree) -> str:
    tree.token_ids[:] = draw(spoiled(tree.token_ids))
    return "token_ids"


def _parent_at(values: Callable[[int], st.SearchStrategy]):
    def change(draw, tree) -> str:
        at = draw(st.integers(0, len(tree.parent) - 1))
        tree.parent[at] = draw(values(at))
        return "parent"

    return change


def _parents_miscounted(draw, tree) -> str:
    tree.parent[:] = list(tree.parent)[:-1] if draw(st.booleans()) else [*tree.parent, -1]
    return "parent"


# Root children with a proposal over them, which the proposal faults break.
ROOT_PROPOSALS = st.lists(TOKENS, min_size=1, max_size=4, unique=True).map(
    lambda children: common_pb2.DraftTree(
        token_ids=children, parent=[-1] * len(children), expanded_nodes=[-1],
        proposal=[common_pb2.SparseDistribution(token_ids=children, probs=[1 / len(children)] * len(children))],
    )
)


def _bad_probs(draw, tree) -> str:
    proposal = tree.proposal[0]
    proposal.probs[:] = draw(spoiled(proposal.probs, st.floats(1.01, 3) | st.floats(max_value=-TINY, width=32) | st.just(math.nan)))
    return "probs"


def _child_missed(draw, tree) -> str:
    tree.proposal[0].token_ids[0] = next(t for t in range(VOCAB) if t not in tree.token_ids)
    return "proposal"


def _proposal_outside(draw, tree) -> str:
    tree.proposal[0].token_ids[0] = draw(BAD_TOKENS)
    return "proposal"


def _expanded_outside(draw, tree) -> str:
    tree.expanded_nodes[0] = draw(st.integers(len(tree.token_ids), INT32[1]) | st.integers(INT32[0], -2))
    return "expanded_nodes"


def _expanded_twice(draw, tree) -> str:
    tree.expanded_nodes.append(-1)
    tree.proposal.add().CopyFrom(tree.proposal[0])
    return "expanded_nodes"


def _proposal_missing(draw, tree) -> str:
    tree.expanded_nodes.append(0)
    return "expanded_nodes"


def _siblings_repeat(draw, tree) -> str:
    tree.token_ids.append(tree.token_ids[0])
    tree.parent.append(-1)
    return "token_ids"


def huge_tree(draw, request) -> Fault:
    size = draw(st.integers(LIMITS.max_tree_nodes + 1, LIMITS.max_tree_nodes + 40))
    request.fused_tokens = 0
    request.tree.CopyFrom(common_pb2.DraftTree(token_ids=[1] * size, parent=list(range(-1, size - 1))))
    return Fault("tree")


def fused_and_tree(draw, request) -> Fault:
    if not request.tree.token_ids:
        request.tree.CopyFrom(draw(draft_trees()))
    request.fused_tokens = draw(st.integers(1, LIMITS.max_fused_tokens))
    return Fault("fused_tokens")


def too_many_fused(draw, request) -> Fault:
    request.ClearField("tree")
    request.fused_tokens = draw(st.integers(LIMITS.max_fused_tokens + 1, UINT32_MAX))
    return Fault("fused_tokens")


def prompt_past_context(draw, request) -> Fault:
    request.start.prompt_length = draw(st.integers(len(request.start.context_token_ids) + 1, UINT32_MAX))
    return Fault("prompt_length")


def verify_past_context(draw, request) -> Fault:
    """A context the model takes, with more verifier tokens than fit after it."""
    start = request.start
    start.context_token_ids[:] = draw(st.lists(TOKENS, min_size=MAX_CONTEXT - 20, max_size=MAX_CONTEXT - 1))
    request.ClearField("tree")
    request.fused_tokens = draw(st.integers(MAX_CONTEXT + 1 - len(start.context_token_ids), LIMITS.max_fused_tokens))
    return Fault("context", grpc.StatusCode.OUT_OF_RANGE)


VERIFY_FAULTS = SESSION_FAULTS | CONTEXT_FAULTS | {
    "round-out-of-order": setting("round", st.just(0) | st.integers(2, UINT32_MAX), code=grpc.StatusCode.FAILED_PRECONDITION),
    "prompt_length-past-context": prompt_past_context,
    # The tiny verifier has neither a feature head nor a steering checkpoint.
    "keep_verifier_state": setting("start.keep_verifier_state", st.just(True)), "steering": setting("steering", st.just(True)),
    "verifier_state": setting("verifier_state", st.just(True)),
    "tree-token-outside-vocabulary": tree_fault(_token_outside),
    "parent-not-before-child": tree_fault(_parent_at(lambda at: st.integers(at, INT32[1]))),
    "parent-below-root": tree_fault(_parent_at(lambda at: st.integers(INT32[0], -2))),
    "parents-miscounted": tree_fault(_parents_miscounted), "huge-tree": huge_tree,
    "bad-probs": tree_fault(_bad_probs, ROOT_PROPOSALS), "proposal-misses-child": tree_fault(_child_missed, ROOT_PROPOSALS),
    "proposal-outside-vocabulary": tree_fault(_proposal_outside, ROOT_PROPOSALS),
    "expanded-node-outside-tree": tree_fault(_expanded_outside, ROOT_PROPOSALS),
    "node-expanded-twice": tree_fault(_expanded_twice, ROOT_PROPOSALS), "proposal-missing": tree_fault(_proposal_missing, ROOT_PROPOSALS),
    "sampled-siblings-repeat": tree_fault(_siblings_repeat, ROOT_PROPOSALS),
    "fused-with-tree": fused_and_tree, "too-many-fused": too_many_fused, "verify-past-context": verify_past_context,
}


def verify_answer_holds(request: verifier_pb2.VerifyRequest, answers: list[verifier_pb2.VerifyResponse]) -> None:
    (answer,) = answers
    assert answer.committed_length == len(request.start.context_token_ids) + len(answer.token_ids), answer
    assert answer.num_accepted_draft_tokens <= len(request.tree.token_ids), answer


# --- Draft ---------------------------------------------------------------------------------

@st.composite
def tree_shapes(draw) -> common_pb2.TreeShape:
    """Valid shapes; empty fields take the server's defaults."""
    return common_pb2.TreeShape(
        method=draw(st.sampled_from(("",) + TREE_METHODS)), branching=draw(st.lists(st.integers(1, CAP), max_size=4)),
        width=draw(st.integers(0, 8) | st.just(CAP)), max_depth=draw(st.integers(0, CAP)),
        ngram=draw(st.sampled_from(("", "none") + NGRAM_METHODS)),
    )


def shape_faults(path: str) -> dict[str, Breaker]:
    """Breakers of the TreeShape at `path`: an unknown method or n-gram choice, sizes past a draft's."""
    bad_branching = st.builds(
        lambda good, bad, at: good[:at] + [bad] + good[at:], st.lists(st.integers(1, CAP), max_size=3), st.just(0) | BAD_SIZES,
        st.integers(0, 3),
    ) | st.lists(st.integers(1, CAP), min_size=CAP + 1, max_size=CAP + 4)
    return {
        "bad-method": setting(f"{path}.method", st.text(min_size=1, max_size=12).filter(lambda m: m not in TREE_METHODS)),
        "bad-branching": setting(f"{path}.branching", bad_branching), "bad-width": setting(f"{path}.width", BAD_SIZES),
        "bad-max_depth": setting(f"{path}.max_depth", BAD_SIZES),
        "bad-ngram": setting(f"{path}.ngram", st.text(min_size=1, max_size=12).filter(lambda m: m not in ("none", *NGRAM_METHODS))),
    }


@st.composite
def draft_requests(draw) -> drafter_pb2.DraftRequest:
    start = draw(session_starts())
    new = draw(st.lists(TOKENS, max_size=4))
    request = drafter_pb2.DraftRequest(
        session_id=draw(SESSION_IDS), round=draw(st.integers(0, UINT32_MAX)), start=start, new_token_ids=new,
        committed_length=len(start.context_token_ids) + len(new), num_draft_tokens=draw(st.integers(1, 8) | st.just(CAP)),
        verifier_tokenizer_fingerprint=draw(st.sampled_from(["", FINGERPRINT])), assumed_token_ids=draw(st.lists(TOKENS, max_size=3)),
        pick_excludes=draw(st.lists(TOKENS, max_size=3)),
    )
    if draw(st.booleans()):
        request.tree_shape.CopyFrom(draw(tree_shapes()))
    return request


def keeping_committed_length(breaker: Breaker) -> Breaker:
    """`breaker`, with committed_length still what the request's context and new tokens make."""

    def kept(draw, request) -> Fault:
        fault = breaker(draw, request)
        request.committed_length = len(request.start.context_token_ids) + len(request.new_token_ids)
        return fault

    return kept


def tokens_outside(name: str) -> Breaker:
    def breaker(draw, request) -> Fault:
        getattr(request, name)[:] = draw(spoiled(getattr(request, name)))
        return Fault(name)

    return keeping_committed_length(breaker)


def draft_past_context(draw, request) -> Fault:
    """A context the model takes, with a budget that does not fit after it."""
    request.start.context_token_ids[:] = draw(st.lists(TOKENS, min_size=MAX_CONTEXT - CAP, max_size=MAX_CONTEXT - 1))
    request.committed_length = len(request.start.context_token_ids) + len(request.new_token_ids)
    request.num_draft_tokens = draw(st.integers(max(1, MAX_CONTEXT - request.committed_length - len(request.assumed_token_ids)), CAP))
    return Fault("context", grpc.StatusCode.OUT_OF_RANGE)


def wrong_committed_length(draw, request) -> Fault:
    request.committed_length = draw(st.integers(0, UINT32_MAX).filter(lambda n: n != request.committed_length))
    return Fault("committed_length", grpc.StatusCode.FAILED_PRECONDITION)


TENSORS = st.builds(common_pb2.Tensor, shape=st.just([1, 32]), dtype=st.just("float16"), data=st.binary(min_size=64, max_size=64))
VERIFIER_STATES = st.builds(
    common_pb2.VerifierState, start=st.integers(0, UINT32_MAX), positions=st.integers(0, 8), records=st.binary(max_size=512)
)
DRAFT_FAULTS = SESSION_FAULTS | {
    name: keeping_committed_length(breaker) for name, breaker in CONTEXT_FAULTS.items()
} | shape_faults("tree_shape") | {
    "other-tokenizer": setting("verifier_tokenizer_fingerprint", st.text(min_size=1, max_size=32).filter(lambda f: f != FINGERPRINT)),
    "new-token-outside-vocabulary": tokens_outside("new_token_ids"),
    "assumed-token-outside-vocabulary": tokens_outside("assumed_token_ids"),
    "excluded-token-outside-vocabulary": tokens_outside("pick_excludes"),
    "bad-num_draft_tokens": setting("num_draft_tokens", st.just(0) | st.integers(CAP + 1, UINT32_MAX)),
    "wrong-committed_length": wrong_committed_length, "draft-past-context": draft_past_context,
    # The tiny drafter has no steering checkpoint and reads no verifier state.
    "steering": setting("steering", TENSORS), "verifier_state": setting("verifier_state", VERIFIER_STATES),
}


def draft_answer_holds(request: drafter_pb2.DraftRequest, answers: list[drafter_pb2.DraftResponse]) -> None:
    (answer,) = answers
    assert len(answer.tree.token_ids) == len(answer.tree.parent) <= request.num_draft_tokens, answer


# --- Generate ------------------------------------------------------------------------------

# Words of the vocabulary and others (each a <unk>), none of them whitespace.
PROMPT_WORDS = st.sampled_from(WORDS) | st.text(st.characters(categories=["L", "N", "P", "S"]), min_size=1, max_size=6)


@st.composite
def generate_requests(draw) -> coordinator_pb2.GenerateRequest:
    request = coordinator_pb2.GenerateRequest(
        temperature=draw(TEMPERATURES), top_k=draw(TOP_KS), seed=draw(st.integers(0, 2**64 - 1)),
        stop=draw(st.lists(st.text(min_size=1, max_size=LIMITS.max_stop_string_chars), max_size=3)),
    )
    if draw(st.booleans()):
        request.prompt_token_ids[:] = draw(st.lists(TOKENS, min_size=1, max_size=6))
    else:
        request.prompt = " ".join(draw(st.lists(PROMPT_WORDS, min_size=1, max_size=8)))
        request.use_chat_template = draw(st.booleans())
    optional = {  # unset: the server's defaults
        "max_new_tokens": st.integers(1, 12), "top_p": st.floats(0, 1, exclude_min=True, width=32),
        "num_draft_tokens": st.integers(0, 8) | st.just(CAP), "adaptive": st.booleans(), "overlap": st.booleans(),
        "steering": st.just(False),
    }
    for name, values in optional.items():
        if draw(st.booleans()):
            setattr(request, name, draw(values))
    if draw(st.booleans()):
        request.tree.CopyFrom(draw(tree_shapes()))
    return request


def prompt_fault(
    named: str, prompt: st.SearchStrategy = st.just(""), ids: st.SearchStrategy = EMPTY, chat_template: bool = False
) -> Breaker:
    """A breaker replacing the prompt fields with `prompt`, `ids` and `chat_template`."""

    def breaker(draw, request) -> Fault:
        request.prompt, request.prompt_token_ids[:], request.use_chat_template = draw(prompt), draw(ids), chat_template
        return Fault(named)

    return breaker


def stop_fault(change: Callable[[list[str]], list[str]]) -> Breaker:
    """A breaker replacing the stop strings with `change(the valid ones)`."""

    def breaker(draw, request) -> Fault:
        request.stop[:] = change(list(request.stop))
        return Fault("stop")

    return breaker


SOME_IDS = st.lists(TOKENS, min_size=1, max_size=6)
GENERATE_FAULTS = shape_faults("tree") | {
    "both-prompts": prompt_fault("prompt", st.just("w1"), SOME_IDS), "no-prompt": prompt_fault("prompt"),
    "blank-prompt": prompt_fault("prompt", st.text(" \t\n\r", min_size=1, max_size=8)),
    "long-prompt-ids": prompt_fault("prompt", ids=LONG_CONTEXTS),
    # Past the context in tokens, then in the characters it can hold.
    "long-prompt": prompt_fault("prompt", st.integers(MAX_CONTEXT, 3 * MAX_CONTEXT).map(lambda n: " ".join(["w1"] * n))),
    "prompt-ids-outside-vocabulary": prompt_fault("prompt_token_ids", ids=SOME_IDS.flatmap(spoiled)),
    "chat-template-for-ids": prompt_fault("use_chat_template", ids=SOME_IDS, chat_template=True),
    "empty-stop": stop_fault(lambda stop: stop + [""]),
    "too-many-stops": stop_fault(lambda stop: stop + ["s"] * (LIMITS.max_stop_strings + 1 - len(stop))),
    "long-stop": stop_fault(lambda stop: stop + ["s" * (LIMITS.max_stop_string_chars + 1)]),
    "bad-max_new_tokens": setting("max_new_tokens", st.integers(INT32[0], 0) | st.integers(LIMITS.max_new_tokens + 1, INT32[1])),
    "bad-temperature": setting("temperature", BAD_TEMPERATURES),
    "bad-top_p": setting("top_p", BAD_TOP_PS | st.just(0.0)),  # set, 0 is no nucleus
    "bad-top_k": setting("top_k", BAD_TOP_KS),
    "bad-num_draft_tokens": setting("num_draft_tokens", st.integers(INT32[0], -1) | st.integers(CAP + 1, INT32[1])),
    "steering": setting("steering", st.just(True)),  # the tiny pair has no steering checkpoint
}


def generate_answer_holds(request: coordinator_pb2.GenerateRequest, answers: list[coordinator_pb2.GenerateResponse]) -> None:
    assert answers[-1].finish_reason in ("stop", "length"), answers[-1]
    if request.HasField("max_new_tokens"):
        assert sum(len(answer.token_ids) for answer in answers) <= request.max_new_tokens


# --- the RPCs --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rpc:
    target: str  # the service that answers
    service: str
    method: str
    answer_type: type
    valid: st.SearchStrategy
    faults: dict[str, Breaker] = field(default_factory=dict)
    answer_holds: Callable = lambda request, answers: None  # on the answers to a valid request
    valid_examples: int = 20
    streaming: bool = False

    def __str__(self) -> str:
        return f"{self.target}.{self.method}"

    def any_case(self) -> st.SearchStrategy[Case]:
        """Valid requests, and as many broken in one field or another."""
        return cases(self.valid) | st.one_of(*(cases(self.valid, breaker) for breaker in self.faults.values()))


END_SESSIONS = st.builds(common_pb2.EndSessionRequest, session_id=SESSION_IDS | NEVER_OPENED)
END_SESSION_FAULTS = {"empty-session_id": setting("session_id", st.just(""))}
# Valid examples: fewer where a call is slow (a whole generation) or the request simple.
VERIFY = Rpc(
    "verifier", VERIFIER_SERVICE, "Verify", verifier_pb2.VerifyResponse, verify_requests(), VERIFY_FAULTS, verify_answer_holds,
    valid_examples=100,
)
DRAFT = Rpc(
    "drafter", DRAFTER_SERVICE, "Draft", drafter_pb2.DraftResponse, draft_requests(), DRAFT_FAULTS, draft_answer_holds, valid_examples=100
)
GENERATE = Rpc(
    "coordinator", COORDINATOR_SERVICE, "Generate", coordinator_pb2.GenerateResponse, generate_requests(), GENERATE_FAULTS,
    generate_answer_holds, valid_examples=40,
)
INFO = Rpc("verifier", VERIFIER_SERVICE, "Info", common_pb2.ModelInfo, st.just(common_pb2.InfoRequest()))
RPCS = [
    VERIFY, DRAFT, GENERATE, INFO,
    Rpc(
        "coordinator", COORDINATOR_SERVICE, "GenerateStream", coordinator_pb2.GenerateResponse, generate_requests(), GENERATE_FAULTS,
        generate_answer_holds, valid_examples=25, streaming=True,
    ),
    Rpc("verifier", VERIFIER_SERVICE, "EndSession", common_pb2.EndSessionResponse, END_SESSIONS, END_SESSION_FAULTS),
    Rpc("drafter", DRAFTER_SERVICE, "EndSession", common_pb2.EndSessionResponse, END_SESSIONS, END_SESSION_FAULTS),
]
FAULTS = [pytest.param(rpc, breaker, id=f"{rpc}-{name}") for rpc in RPCS for name, breaker in rpc.faults.items()]
# No example database: the parametrized tests share their inner test, so one's saved examples
# would replay for another; the printed seed replays a run.
FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def channels(tiny_dirs):
    """Channels to each service of one stack, which must still serve a whole generation once
    the module's tests have sent it everything."""
    from tests.conftest import local_stack, tiny_config

    # A short default generation, as the requests' own (for time).
    with local_stack(tiny_config(tiny_dirs, default_max_new_tokens=8)) as stack:
        opened = {name: grpc.insecure_channel(stack[name]) for name in ("verifier", "drafter", "coordinator")}
        try:
            yield opened
            client = CoordinatorClient(stack["coordinator"])
            try:
                assert len(client.generate(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=8)).token_ids) >= 1
            finally:
                client.close()
        finally:
            for channel in opened.values():
                channel.close()


@pytest.fixture
def seeded(request):
    """Runs a hypothesis test from a seed printed first, which pytest shows with a failure;
    `--hypothesis-seed=N` runs it again. Under a derandomized profile (ci) the examples are the
    same every run, with no seed to print."""

    def wrap(test):
        if settings().derandomize:
            return test
        forced = request.config.getoption("--hypothesis-seed")
        if forced is not None:  # hypothesis itself seeds every test with it
            print(f"hypothesis seed {forced}")
            return test
        chosen = random.getrandbits(64)
        print(f"hypothesis seed {chosen}: rerun with --hypothesis-seed={chosen}")
        return seed(chosen)(test)

    return wrap


def _call(channel, rpc: Rpc, payload: bytes) -> tuple[grpc.StatusCode, str, list]:
    """The status, its message and the answers of one call with these request bytes."""
    path = f"/{rpc.service}/{rpc.method}"
    try:
        if rpc.streaming:
            answers = list(channel.unary_stream(path, response_deserializer=rpc.answer_type.FromString)(payload, timeout=30))
        else:
            answers = [channel.unary_unary(path, response_deserializer=rpc.answer_type.FromString)(payload, timeout=30)]
    except grpc.RpcError as err:
        return err.code(), err.details() or "", []
    return grpc.StatusCode.OK, "", answers


def _judge(rpc: Rpc, case: Case, code: grpc.StatusCode, details: str, answers: list) -> None:
    if case.fault is None:
        assert code == grpc.StatusCode.OK, f"{rpc} refused a valid request: {code.name}: {details}"
        rpc.answer_holds(case.request, answers)
    else:
        expected = f"{case.fault.code.name} naming {case.fault.named!r}"
        assert code == case.fault.code, f"{rpc} answered {code.name} ({details!r}), not {expected}"
        assert case.fault.named in details, f"{rpc} answered {details!r}, not {expected}"


def _fuzz(channels, seeded, rpc: Rpc, strategy: st.SearchStrategy[Case], examples: int) -> None:
    @settings(FUZZ, max_examples=examples)
    @given(strategy)
    def check(case: Case):
        _judge(rpc, case, *_call(channels[rpc.target], rpc, case.request.SerializeToString()))

    seeded(check)()


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_valid_requests_are_answered_ok(channels, seeded, rpc):
    """Requests valid in every field, from the usual to the extremes (temperatures from 2^-126
    to 1e30, top_k past the vocabulary, the largest draft budget, the server's defaults): OK,
    with a sound answer."""
    _fuzz(channels, seeded, rpc, cases(rpc.valid), rpc.valid_examples)


@pytest.mark.parametrize("rpc, breaker", FAULTS)
def test_a_request_broken_in_one_field_is_refused_naming_it(channels, seeded, rpc, breaker):
    """Valid requests broken in one field (this test's way): refused with the fitting status
    (INVALID_ARGUMENT; NOT_FOUND for a session never opened, FAILED_PRECONDITION for a round or
    a length out of step, OUT_OF_RANGE past the model's context) and a message naming the
    field."""
    _fuzz(channels, seeded, rpc, cases(rpc.valid, breaker), 8)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


UNUSED_NUMBERS = st.integers(1000, 18999)  # no message here has them (19000-19999 are protobuf's own)
UNKNOWN_FIELDS = st.lists(st.one_of(
    st.builds(lambda n, v: _key(n, 0) + _varint(v), UNUSED_NUMBERS, st.integers(0, 2**64 - 1)),
    st.builds(lambda n, b: _key(n, 1) + b, UNUSED_NUMBERS, st.binary(min_size=8, max_size=8)),
    st.builds(lambda n, b: _key(n, 2) + _varint(len(b)) + b, UNUSED_NUMBERS, st.binary(max_size=32)),
    st.builds(lambda n, b: _key(n, 5) + b, UNUSED_NUMBERS, st.binary(min_size=4, max_size=4)),
), min_size=1, max_size=3).map(b"".join)
# Bytes no parser reads, whatever comes before them.
UNREADABLE_ENDINGS = st.one_of(
    st.builds(_key, UNUSED_NUMBERS, st.sampled_from([3, 4, 6, 7])),  # a group never closed or never opened; no such wire type
    st.just(b"\x00"),  # field number 0
    st.builds(lambda n, b: _key(n, 2) + _varint(len(b) + 1) + b, UNUSED_NUMBERS, st.binary(max_size=32)),  # shorter than it says
    st.builds(lambda n: _key(n, 0) + b"\x80", UNUSED_NUMBERS),  # a varint cut short
)


@pytest.mark.parametrize("rpc", [VERIFY, DRAFT, GENERATE, INFO], ids=str)
def test_appended_bytes_are_skipped_or_refused_by_grpc(channels, seeded, rpc):
    """Bytes appended to a request (valid or broken in one field): fields no message has leave
    its answer what it was (parsers skip them); unreadable ones are refused by gRPC itself, as it
    deserializes, before any code of ours runs."""

    @settings(FUZZ, max_examples=40)
    @given(rpc.any_case(), st.tuples(st.just(True), UNKNOWN_FIELDS) | st.tuples(st.just(False), UNREADABLE_ENDINGS))
    def check(case: Case, appended: tuple[bool, bytes]):
        readable, tail = appended
        code, details, answers = _call(channels[rpc.target], rpc, case.request.SerializeToString() + tail)
        if readable:
            _judge(rpc, case, code, details, answers)
        else:
            assert (code, details) == (grpc.StatusCode.INTERNAL, "Exception deserializing request!")

    seeded(check)()
