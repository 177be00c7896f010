from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "use_chat_template", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "num_draft_tokens", "tree", "adaptive", "overlap", "steering", "constraint")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    USE_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    use_chat_template: bool
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_draft_tokens: int
    tree: _common_pb2.TreeShape
    adaptive: bool
    overlap: bool
    steering: bool
    constraint: _common_pb2.Constraint
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., use_chat_template: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., num_draft_tokens: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.TreeShape, _Mapping]] = ..., adaptive: _Optional[bool] = ..., overlap: _Optional[bool] = ..., steering: _Optional[bool] = ..., constraint: _Optional[_Union[_common_pb2.Constraint, _Mapping]] = ...) -> None: ...

class RoundStats(_message.Message):
    __slots__ = ("rounds", "mean_accepted_per_round", "draft_compute_ms", "verify_compute_ms", "wire_serialization_ms", "serialization_ms", "bytes_sent", "bytes_received", "speculation_budget", "total_ms", "generated_tokens", "tokens_per_second", "accepted_draft_tokens", "drafted_tokens", "tree_method", "bytes_per_round", "draft_wire_ms", "verify_wire_ms", "policy", "mean_budget", "plan_rounds", "overlap", "overlap_hits", "steering", "steering_bytes", "verify_steering_ms", "draft_steering_ms", "verifier_state", "verifier_state_bytes", "drafter_failures", "speculative_rounds", "accepted_per_position", "draft_forward_passes", "drafter_replica", "verifier_replica", "replica_moves", "session_reopens", "speculative_anatomy", "verifier_alone_anatomy", "draft_own_tokens", "draft_reencode_rollbacks", "draft_mapping_ms", "grammar_compile_ms", "grammar_mask_ms", "grammar_draft_ms", "forced_tokens", "accepted_forced_tokens", "first_token_ms")
    class PlanRoundsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    WIRE_SERIALIZATION_MS_FIELD_NUMBER: _ClassVar[int]
    SERIALIZATION_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_METHOD_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WIRE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_WIRE_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MEAN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PLAN_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_HITS_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    STEERING_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEERING_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_STEERING_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_STATE_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_REPLICA_FIELD_NUMBER: _ClassVar[int]
    REPLICA_MOVES_FIELD_NUMBER: _ClassVar[int]
    SESSION_REOPENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_ANATOMY_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_ALONE_ANATOMY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_OWN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REENCODE_ROLLBACKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MAPPING_MS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_COMPILE_MS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_MASK_MS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    mean_accepted_per_round: float
    draft_compute_ms: float
    verify_compute_ms: float
    wire_serialization_ms: float
    serialization_ms: float
    bytes_sent: int
    bytes_received: int
    speculation_budget: int
    total_ms: float
    generated_tokens: int
    tokens_per_second: float
    accepted_draft_tokens: int
    drafted_tokens: int
    tree_method: str
    bytes_per_round: float
    draft_wire_ms: float
    verify_wire_ms: float
    policy: str
    mean_budget: float
    plan_rounds: _containers.ScalarMap[str, int]
    overlap: bool
    overlap_hits: int
    steering: bool
    steering_bytes: int
    verify_steering_ms: float
    draft_steering_ms: float
    verifier_state: bool
    verifier_state_bytes: int
    drafter_failures: int
    speculative_rounds: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    draft_forward_passes: int
    drafter_replica: str
    verifier_replica: str
    replica_moves: int
    session_reopens: int
    speculative_anatomy: RoundAnatomy
    verifier_alone_anatomy: RoundAnatomy
    draft_own_tokens: int
    draft_reencode_rollbacks: int
    draft_mapping_ms: float
    grammar_compile_ms: float
    grammar_mask_ms: float
    grammar_draft_ms: float
    forced_tokens: int
    accepted_forced_tokens: int
    first_token_ms: float
    def __init__(self, rounds: _Optional[int] = ..., mean_accepted_per_round: _Optional[float] = ..., draft_compute_ms: _Optional[float] = ..., verify_compute_ms: _Optional[float] = ..., wire_serialization_ms: _Optional[float] = ..., serialization_ms: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., speculation_budget: _Optional[int] = ..., total_ms: _Optional[float] = ..., generated_tokens: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., accepted_draft_tokens: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., tree_method: _Optional[str] = ..., bytes_per_round: _Optional[float] = ..., draft_wire_ms: _Optional[float] = ..., verify_wire_ms: _Optional[float] = ..., policy: _Optional[str] = ..., mean_budget: _Optional[float] = ..., plan_rounds: _Optional[_Mapping[str, int]] = ..., overlap: _Optional[bool] = ..., overlap_hits: _Optional[int] = ..., steering: _Optional[bool] = ..., steering_bytes: _Optional[int] = ..., verify_steering_ms: _Optional[float] = ..., draft_steering_ms: _Optional[float] = ..., verifier_state: _Optional[bool] = ..., verifier_state_bytes: _Optional[int] = ..., drafter_failures: _Optional[int] = ..., speculative_rounds: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., draft_forward_passes: _Optional[int] = ..., drafter_replica: _Optional[str] = ..., verifier_replica: _Optional[str] = ..., replica_moves: _Optional[int] = ..., session_reopens: _Optional[int] = ..., speculative_anatomy: _Optional[_Union[RoundAnatomy, _Mapping]] = ..., verifier_alone_anatomy: _Optional[_Union[RoundAnatomy, _Mapping]] = ..., draft_own_tokens: _Optional[int] = ..., draft_reencode_rollbacks: _Optional[int] = ..., draft_mapping_ms: _Optional[float] = ..., grammar_compile_ms: _Optional[float] = ..., grammar_mask_ms: _Optional[float] = ..., grammar_draft_ms: _Optional[float] = ..., forced_tokens: _Optional[int] = ..., accepted_forced_tokens: _Optional[int] = ..., first_token_ms: _Optional[float] = ...) -> None: ...

class RoundAnatomy(_message.Message):
    __slots__ = ("rounds", "round_ms", "draft_compute_ms", "verify_compute_ms", "draft_hop_ms", "verify_hop_ms", "coordinator_ms", "overhead_ms", "draft_request_bytes", "draft_response_bytes", "verify_request_bytes", "verify_response_bytes", "draft_in_service_ms", "verify_in_service_ms")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HOP_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_HOP_MS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_MS_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IN_SERVICE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_IN_SERVICE_MS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    round_ms: float
    draft_compute_ms: float
    verify_compute_ms: float
    draft_hop_ms: float
    verify_hop_ms: float
    coordinator_ms: float
    overhead_ms: float
    draft_request_bytes: float
    draft_response_bytes: float
    verify_request_bytes: float
    verify_response_bytes: float
    draft_in_service_ms: float
    verify_in_service_ms: float
    def __init__(self, rounds: _Optional[int] = ..., round_ms: _Optional[float] = ..., draft_compute_ms: _Optional[float] = ..., verify_compute_ms: _Optional[float] = ..., draft_hop_ms: _Optional[float] = ..., verify_hop_ms: _Optional[float] = ..., coordinator_ms: _Optional[float] = ..., overhead_ms: _Optional[float] = ..., draft_request_bytes: _Optional[float] = ..., draft_response_bytes: _Optional[float] = ..., verify_request_bytes: _Optional[float] = ..., verify_response_bytes: _Optional[float] = ..., draft_in_service_ms: _Optional[float] = ..., verify_in_service_ms: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "spans", "rounds")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: RoundStats
    spans: _containers.RepeatedCompositeFieldContainer[TextSpan]
    rounds: _containers.RepeatedCompositeFieldContainer[RoundInfo]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[RoundStats, _Mapping]] = ..., spans: _Optional[_Iterable[_Union[TextSpan, _Mapping]]] = ..., rounds: _Optional[_Iterable[_Union[RoundInfo, _Mapping]]] = ...) -> None: ...

class TextSpan(_message.Message):
    __slots__ = ("chars", "tokens", "drafted")
    CHARS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    chars: int
    tokens: int
    drafted: bool
    def __init__(self, chars: _Optional[int] = ..., tokens: _Optional[int] = ..., drafted: _Optional[bool] = ...) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("plan", "drafted_tokens", "accepted_draft_tokens", "tokens", "round_ms", "draft_ms", "verify_ms", "wire_ms")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUND_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    WIRE_MS_FIELD_NUMBER: _ClassVar[int]
    plan: str
    drafted_tokens: int
    accepted_draft_tokens: int
    tokens: int
    round_ms: float
    draft_ms: float
    verify_ms: float
    wire_ms: float
    def __init__(self, plan: _Optional[str] = ..., drafted_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., tokens: _Optional[int] = ..., round_ms: _Optional[float] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., wire_ms: _Optional[float] = ...) -> None: ...
