from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("token_ids", "parent", "expanded_nodes", "proposal")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    EXPANDED_NODES_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parent: _containers.RepeatedScalarFieldContainer[int]
    expanded_nodes: _containers.RepeatedScalarFieldContainer[int]
    proposal: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., parent: _Optional[_Iterable[int]] = ..., expanded_nodes: _Optional[_Iterable[int]] = ..., proposal: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ...) -> None: ...

class TreeShape(_message.Message):
    __slots__ = ("method", "branching", "width", "max_depth", "ngram")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BRANCHING_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NGRAM_FIELD_NUMBER: _ClassVar[int]
    method: str
    branching: _containers.RepeatedScalarFieldContainer[int]
    width: int
    max_depth: int
    ngram: str
    def __init__(self, method: _Optional[str] = ..., branching: _Optional[_Iterable[int]] = ..., width: _Optional[int] = ..., max_depth: _Optional[int] = ..., ngram: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class VerifierState(_message.Message):
    __slots__ = ("start", "positions", "records")
    START_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    start: int
    positions: int
    records: bytes
    def __init__(self, start: _Optional[int] = ..., positions: _Optional[int] = ..., records: _Optional[bytes] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "tokenizer_fingerprint", "eos_token_ids", "max_context", "hidden_size", "num_layers", "steering_size", "steering_fingerprint", "verifier_state", "active_sessions", "kv_cache_mib", "resident_mib", "forward_passes", "batched_calls", "batched_jobs", "batch_queue_ms", "prefix_hit_tokens", "prefix_read_tokens", "evicted_sessions", "weight_format")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STEERING_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEERING_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_STATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_MIB_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_MIB_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_CALLS_FIELD_NUMBER: _ClassVar[int]
    BATCHED_JOBS_FIELD_NUMBER: _ClassVar[int]
    BATCH_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_READ_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    hidden_size: int
    num_layers: int
    steering_size: int
    steering_fingerprint: str
    verifier_state: str
    active_sessions: int
    kv_cache_mib: float
    resident_mib: float
    forward_passes: int
    batched_calls: int
    batched_jobs: int
    batch_queue_ms: float
    prefix_hit_tokens: int
    prefix_read_tokens: int
    evicted_sessions: int
    weight_format: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., steering_size: _Optional[int] = ..., steering_fingerprint: _Optional[str] = ..., verifier_state: _Optional[str] = ..., active_sessions: _Optional[int] = ..., kv_cache_mib: _Optional[float] = ..., resident_mib: _Optional[float] = ..., forward_passes: _Optional[int] = ..., batched_calls: _Optional[int] = ..., batched_jobs: _Optional[int] = ..., batch_queue_ms: _Optional[float] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_read_tokens: _Optional[int] = ..., evicted_sessions: _Optional[int] = ..., weight_format: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class SessionStart(_message.Message):
    __slots__ = ("context_token_ids", "sampling", "prompt_length", "keep_verifier_state", "constraint")
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KEEP_VERIFIER_STATE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    context_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    prompt_length: int
    keep_verifier_state: bool
    constraint: Constraint
    def __init__(self, context_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_length: _Optional[int] = ..., keep_verifier_state: _Optional[bool] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_object", "json_schema", "regex", "grammar", "choice")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    json_object: bool
    json_schema: str
    regex: str
    grammar: str
    choice: Choices
    def __init__(self, json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...
