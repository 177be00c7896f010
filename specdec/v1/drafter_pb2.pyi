from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "round", "start", "new_token_ids", "committed_length", "num_draft_tokens", "verifier_tokenizer_fingerprint", "tree_shape", "assumed_token_ids", "steering", "verifier_state", "pick_excludes", "forced_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TREE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_STATE_FIELD_NUMBER: _ClassVar[int]
    PICK_EXCLUDES_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    start: _common_pb2.SessionStart
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed_length: int
    num_draft_tokens: int
    verifier_tokenizer_fingerprint: str
    tree_shape: _common_pb2.TreeShape
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    steering: _common_pb2.Tensor
    verifier_state: _common_pb2.VerifierState
    pick_excludes: _containers.RepeatedScalarFieldContainer[int]
    forced_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., start: _Optional[_Union[_common_pb2.SessionStart, _Mapping]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., committed_length: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., verifier_tokenizer_fingerprint: _Optional[str] = ..., tree_shape: _Optional[_Union[_common_pb2.TreeShape, _Mapping]] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., steering: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., verifier_state: _Optional[_Union[_common_pb2.VerifierState, _Mapping]] = ..., pick_excludes: _Optional[_Iterable[int]] = ..., forced_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("tree", "assumed_token_ids", "compute_ms", "handler_ms", "steering_ms", "forward_passes", "confidence", "own_tokens_drafted", "reencode_rollbacks", "mapping_ms")
    TREE_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    HANDLER_MS_FIELD_NUMBER: _ClassVar[int]
    STEERING_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    OWN_TOKENS_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    REENCODE_ROLLBACKS_FIELD_NUMBER: _ClassVar[int]
    MAPPING_MS_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.DraftTree
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    compute_ms: float
    handler_ms: float
    steering_ms: float
    forward_passes: int
    confidence: _containers.RepeatedScalarFieldContainer[float]
    own_tokens_drafted: int
    reencode_rollbacks: int
    mapping_ms: float
    def __init__(self, tree: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., compute_ms: _Optional[float] = ..., handler_ms: _Optional[float] = ..., steering_ms: _Optional[float] = ..., forward_passes: _Optional[int] = ..., confidence: _Optional[_Iterable[float]] = ..., own_tokens_drafted: _Optional[int] = ..., reencode_rollbacks: _Optional[int] = ..., mapping_ms: _Optional[float] = ...) -> None: ...
