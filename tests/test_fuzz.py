"""Fuzzing every RPC of the three services with random and mutated messages (hypothesis, tiny
models, real gRPC): no crash, no hang, every answer OK or a status that says what was wrong,
and the services go on serving."""
from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.serving.client import CoordinatorClient, generate_request
from specdec.serving.wire import COORDINATOR_SERVICE, DRAFTER_SERVICE, VERIFIER_SERVICE
from specdec.v1 import common_pb2, coordinator_pb2, drafter_pb2, verifier_pb2

# Statuses that describe the request or the load. UNKNOWN or INTERNAL would be a crash inside,
# DEADLINE_EXCEEDED a hang, UNAVAILABLE a dead server.
CLEAR = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
}
RPCS = [
    ("verifier", VERIFIER_SERVICE, "Verify", verifier_pb2.VerifyRequest, False),
    ("verifier", VERIFIER_SERVICE, "EndSession", common_pb2.EndSessionRequest, False),
    ("verifier", VERIFIER_SERVICE, "Info", common_pb2.InfoRequest, False),
    ("drafter", DRAFTER_SERVICE, "Draft", drafter_pb2.DraftRequest, False),
    ("drafter", DRAFTER_SERVICE, "EndSession", common_pb2.EndSessionRequest, False),
    ("coordinator", COORDINATOR_SERVICE, "Generate", coordinator_pb2.GenerateRequest, False),
    ("coordinator", COORDINATOR_SERVICE, "GenerateStream", coordinator_pb2.GenerateRequest, True),
]
TOKENS = st.integers(0, 15)  # the tiny models' vocabulary
# Small values, where a tiny model's vocabulary and a short context live, and the extremes.
INTS = st.one_of(st.integers(-2, 40), st.sampled_from([2**31 - 1, -(2**31), 10**6, 255, 256, 2048]))
FLOATS = st.one_of(st.floats(-2, 3), st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 1e30]))
SCALARS = {
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: st.one_of(st.sampled_from(["", "s1", "chain", "dynamic", "rsd-s", "suffix", "float16"]), st.text(max_size=12)),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),
    FieldDescriptor.TYPE_FLOAT: FLOATS,
    FieldDescriptor.TYPE_DOUBLE: FLOATS,
}


def _value(field: FieldDescriptor, depth: int):
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_of(field.message_type._concrete_class, depth + 1)
    if field.type in SCALARS:
        return SCALARS[field.type]
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    unsigned = field.type in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64)
    return INTS.map(abs) if unsigned else INTS


def message_of(cls, depth: int = 0):
    """Messages of `cls` with a random subset of fields set to random values."""
    fields = [f for f in cls.DESCRIPTOR.fields if not (f.message_type and f.message_type.GetOptions().map_entry) and depth < 3]

    @st.composite
    def build(draw):
        message = cls()
        for field in draw(st.lists(st.sampled_from(fields), unique=True, max_size=len(fields))) if fields else []:
            if field.is_repeated:
                values = draw(st.lists(_value(field, depth), max_size=10))
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    getattr(message, field.name).extend(values)
                else:
                    getattr(message, field.name)[:] = values
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(message, field.name).CopyFrom(draw(_value(field, depth)))
            else:
                setattr(message, field.name, draw(_value(field, depth)))
        return message

    return build()


def _bases():
    """Valid requests, each the skeleton that random fields are grafted onto: a fuzzed call
    gets past the first check and into sessions, trees and sampling. A few session ids, so
    calls meet sessions that earlier ones opened."""
    sessions = st.sampled_from(["a", "b", "c"])
    start = st.builds(
        lambda context, temperature: common_pb2.SessionStart(context_token_ids=context, sampling=common_pb2.SamplingParams(temperature=temperature, seed=1)),
        st.lists(TOKENS, min_size=1, max_size=6), st.sampled_from([0.0, 0.7, 1.0]),
    )
    chain = st.lists(TOKENS, min_size=1, max_size=5).map(lambda ids: common_pb2.DraftTree(token_ids=ids, parent=list(range(-1, len(ids) - 1))))
    return {
        "Verify": st.builds(
            lambda sid, rnd, start, tree, fused: verifier_pb2.VerifyRequest(session_id=sid, round=rnd, start=start, tree=tree, fused_tokens=0 if tree else fused),
            sessions, st.integers(1, 4), start, st.one_of(st.none(), chain), st.integers(0, 3),
        ),
        "Draft": st.builds(
            lambda sid, rnd, start, n, method: drafter_pb2.DraftRequest(
                session_id=sid, round=rnd, start=start, committed_length=len(start.context_token_ids), num_draft_tokens=n,
                tree_shape=common_pb2.TreeShape(method=method),
            ),
            sessions, st.integers(1, 4), start, st.integers(1, 8), st.sampled_from(["chain", "dynamic", "rsd-s", "static", "lattice"]),
        ),
        "Generate": st.builds(
            lambda ids, n, t, budget: generate_request(prompt_token_ids=ids, max_new_tokens=n, temperature=t, num_draft_tokens=budget),
            st.lists(TOKENS, min_size=1, max_size=6), st.integers(1, 12), st.sampled_from([0.0, 0.8]), st.integers(0, 6),
        ),
    }


def grafted(method: str, cls):
    """A valid request with some of its fields replaced by random ones."""
    base = _bases().get(method)
    if base is None:
        return message_of(cls)

    @st.composite
    def build(draw):
        message, noise = draw(base), draw(message_of(cls))
        for field, _ in noise.ListFields():
            if draw(st.integers(0, 3)) == 0:  # a few fields at a time
                message.ClearField(field.name)
                if field.is_repeated:
                    getattr(message, field.name).extend(getattr(noise, field.name))
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    getattr(message, field.name).CopyFrom(getattr(noise, field.name))
                else:
                    setattr(message, field.name, getattr(noise, field.name))
        return message

    return build()


def mutated(payload: bytes):
    """Byte-level damage to a serialized message: flips, cuts and insertions."""
    return st.lists(st.tuples(st.integers(0, max(len(payload), 1)), st.integers(0, 255), st.sampled_from(["flip", "cut", "insert"])), max_size=4).map(
        lambda edits: _apply(payload, edits)
    )


def _apply(payload: bytes, edits) -> bytes:
    data = bytearray(payload)
    for where, byte, kind in edits:
        where = min(where, len(data))
        if kind == "insert":
            data[where:where] = bytes([byte])
        elif kind == "cut":
            del data[where:]
        elif where < len(data):
            data[where] ^= byte
    return bytes(data)


@pytest.fixture(scope="module")
def channels(tiny_dirs):
    from tests.conftest import local_stack, tiny_config

    with local_stack(tiny_config(tiny_dirs)) as stack:
        opened = {name: grpc.insecure_channel(stack[name]) for name in ("verifier", "drafter", "coordinator")}
        yield opened, stack
        for channel in opened.values():
            channel.close()


def _call(channel, service: str, method: str, payload: bytes, streaming: bool) -> grpc.StatusCode:
    path = f"/{service}/{method}"
    try:
        if streaming:
            for _ in channel.unary_stream(path)(payload, timeout=30):
                pass
        else:
            channel.unary_unary(path)(payload, timeout=30)
    except grpc.RpcError as err:
        return err.code(), err.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("target, service, method, request_type, streaming", RPCS, ids=[f"{r[0]}.{r[2]}" for r in RPCS])
def test_random_messages_get_clear_answers(channels, target, service, method, request_type, streaming):
    opened, stack = channels

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.one_of(message_of(request_type), grafted(method.removesuffix("Stream"), request_type), grafted(method.removesuffix("Stream"), request_type)))
    def check(message):
        code, details = _call(opened[target], service, method, message.SerializeToString(), streaming)
        assert code in CLEAR, f"{method}({message}) -> {code.name}: {details}"

    check()
    _still_serving(stack)


@pytest.mark.parametrize("target, service, method, request_type, streaming", RPCS[:1] + RPCS[3:4] + RPCS[5:6], ids=["verifier", "drafter", "coordinator"])
def test_mutated_bytes_get_clear_answers(channels, target, service, method, request_type, streaming):
    """Damaged payloads: one that still parses is judged like any message; one that does not
    is refused by gRPC itself before any of our code runs."""
    opened, stack = channels
    valid = {
        "Verify": verifier_pb2.VerifyRequest(session_id="m", round=1, start=common_pb2.SessionStart(context_token_ids=[1, 4, 5]), fused_tokens=2),
        "Draft": drafter_pb2.DraftRequest(session_id="m", round=1, start=common_pb2.SessionStart(context_token_ids=[1, 4, 5]), committed_length=3, num_draft_tokens=3),
        "Generate": generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=8),
    }[method].SerializeToString()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(mutated(valid))
    def check(payload):
        code, details = _call(opened[target], service, method, payload, streaming)
        try:
            request_type.FromString(payload)
        except Exception:  # noqa: BLE001 - the payload does not parse
            assert code in CLEAR | {grpc.StatusCode.INTERNAL}, details
            assert code != grpc.StatusCode.INTERNAL or "deserializing" in details, details
            return
        assert code in CLEAR, f"{method} -> {code.name}: {details}"

    check()
    _still_serving(stack)


def _still_serving(stack) -> None:
    client = CoordinatorClient(stack["coordinator"])
    try:
        assert len(client.generate(generate_request(prompt_token_ids=[1, 4, 5], max_new_tokens=8)).token_ids) >= 1
    finally:
        client.close()
