from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "round", "start", "tree", "fused_tokens", "steering", "verifier_state", "forced_drafts")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    FUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_STATE_FIELD_NUMBER: _ClassVar[int]
    FORCED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    start: _common_pb2.SessionStart
    tree: _common_pb2.DraftTree
    fused_tokens: int
    steering: bool
    verifier_state: bool
    forced_drafts: bool
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., start: _Optional[_Union[_common_pb2.SessionStart, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., fused_tokens: _Optional[int] = ..., steering: _Optional[bool] = ..., verifier_state: _Optional[bool] = ..., forced_drafts: _Optional[bool] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("token_ids", "num_accepted_draft_tokens", "committed_length", "compute_ms", "handler_ms", "steering", "steering_ms", "verifier_state", "verifier_state_ms", "batch_rows", "batch_sessions", "grammar_ms", "forced_drafted", "forced_accepted")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    HANDLER_MS_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    STEERING_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_STATE_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_STATE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_MS_FIELD_NUMBER: _ClassVar[int]
    FORCED_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    FORCED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted_draft_tokens: int
    committed_length: int
    compute_ms: float
    handler_ms: float
    steering: _common_pb2.Tensor
    steering_ms: float
    verifier_state: _common_pb2.VerifierState
    verifier_state_ms: float
    batch_rows: float
    batch_sessions: float
    grammar_ms: float
    forced_drafted: int
    forced_accepted: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., num_accepted_draft_tokens: _Optional[int] = ..., committed_length: _Optional[int] = ..., compute_ms: _Optional[float] = ..., handler_ms: _Optional[float] = ..., steering: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., steering_ms: _Optional[float] = ..., verifier_state: _Optional[_Union[_common_pb2.VerifierState, _Mapping]] = ..., verifier_state_ms: _Optional[float] = ..., batch_rows: _Optional[float] = ..., batch_sessions: _Optional[float] = ..., grammar_ms: _Optional[float] = ..., forced_drafted: _Optional[int] = ..., forced_accepted: _Optional[int] = ...) -> None: ...
