from rtp_serve.services.common.pb import nameservice_pb2 as _nameservice_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "block_hashes", "packed_block_hashes", "num_prompt_tokens", "session_id", "priority", "exclude", "lora_name", "frontend_id", "unix_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    packed_block_hashes: bytes
    num_prompt_tokens: int
    session_id: str
    priority: int
    exclude: _containers.RepeatedScalarFieldContainer[str]
    lora_name: str
    frontend_id: str
    unix_ms: int
    def __init__(self, request_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., packed_block_hashes: _Optional[bytes] = ..., num_prompt_tokens: _Optional[int] = ..., session_id: _Optional[str] = ..., priority: _Optional[int] = ..., exclude: _Optional[_Iterable[str]] = ..., lora_name: _Optional[str] = ..., frontend_id: _Optional[str] = ..., unix_ms: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "frontend_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    frontend_id: str
    def __init__(self, request_id: _Optional[str] = ..., frontend_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class RoutePlan(_message.Message):
    __slots__ = ("prefill", "decode", "matched_blocks", "policy", "reason", "predicted_ttft_s", "predicted_wait_s", "predicted_prefill_s", "predicted_fetch_s", "remote_blocks")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FETCH_S_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    prefill: _nameservice_pb2.Member
    decode: _nameservice_pb2.Member
    matched_blocks: int
    policy: str
    reason: str
    predicted_ttft_s: float
    predicted_wait_s: float
    predicted_prefill_s: float
    predicted_fetch_s: float
    remote_blocks: int
    def __init__(self, prefill: _Optional[_Union[_nameservice_pb2.Member, _Mapping]] = ..., decode: _Optional[_Union[_nameservice_pb2.Member, _Mapping]] = ..., matched_blocks: _Optional[int] = ..., policy: _Optional[str] = ..., reason: _Optional[str] = ..., predicted_ttft_s: _Optional[float] = ..., predicted_wait_s: _Optional[float] = ..., predicted_prefill_s: _Optional[float] = ..., predicted_fetch_s: _Optional[float] = ..., remote_blocks: _Optional[int] = ...) -> None: ...

class RouteBatchRequest(_message.Message):
    __slots__ = ("requests", "releases")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RouteRequest]
    releases: _containers.RepeatedCompositeFieldContainer[ReleaseRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[RouteRequest, _Mapping]]] = ..., releases: _Optional[_Iterable[_Union[ReleaseRequest, _Mapping]]] = ...) -> None: ...

class RouteOutcome(_message.Message):
    __slots__ = ("plan", "code", "details")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    plan: RoutePlan
    code: int
    details: str
    def __init__(self, plan: _Optional[_Union[RoutePlan, _Mapping]] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class RouteBatchReply(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[RouteOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[RouteOutcome, _Mapping]]] = ...) -> None: ...

class IndexRequest(_message.Message):
    __slots__ = ("worker_ids", "counts_only")
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    counts_only: bool
    def __init__(self, worker_ids: _Optional[_Iterable[str]] = ..., counts_only: _Optional[bool] = ...) -> None: ...

class WorkerIndex(_message.Message):
    __slots__ = ("worker_id", "incarnation", "seq", "state", "block_hashes", "host_block_hashes", "num_blocks", "num_host_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    seq: int
    state: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    host_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_blocks: int
    num_host_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., state: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., host_block_hashes: _Optional[_Iterable[bytes]] = ..., num_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ...) -> None: ...

class IndexReply(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerIndex]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerIndex, _Mapping]]] = ...) -> None: ...
