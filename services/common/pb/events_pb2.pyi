from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVEvents(_message.Message):
    __slots__ = ("worker_id", "seq", "stored", "removed", "cleared", "incarnation", "host_stored", "host_removed", "published_unix_ns")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HOST_STORED_FIELD_NUMBER: _ClassVar[int]
    HOST_REMOVED_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seq: int
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    cleared: bool
    incarnation: int
    host_stored: _containers.RepeatedScalarFieldContainer[bytes]
    host_removed: _containers.RepeatedScalarFieldContainer[bytes]
    published_unix_ns: int
    def __init__(self, worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., cleared: _Optional[bool] = ..., incarnation: _Optional[int] = ..., host_stored: _Optional[_Iterable[bytes]] = ..., host_removed: _Optional[_Iterable[bytes]] = ..., published_unix_ns: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("worker_id", "num_waiting", "num_running", "free_blocks", "total_blocks", "queued_tokens", "block_size", "unix_ms", "queue_wait_s", "prefill_tokens_per_s", "decode_step_s", "max_num_waiting", "incarnation", "kv_seq", "step_fixed_s", "step_token_s", "step_row_s", "step_token_budget", "fetch_costs", "kv_block_bytes", "remote_tier", "loras", "resident_loras", "max_num_seqs")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    KV_SEQ_FIELD_NUMBER: _ClassVar[int]
    STEP_FIXED_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    STEP_ROW_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    FETCH_COSTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TIER_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_waiting: int
    num_running: int
    free_blocks: int
    total_blocks: int
    queued_tokens: int
    block_size: int
    unix_ms: int
    queue_wait_s: float
    prefill_tokens_per_s: float
    decode_step_s: float
    max_num_waiting: int
    incarnation: int
    kv_seq: int
    step_fixed_s: float
    step_token_s: float
    step_row_s: float
    step_token_budget: int
    fetch_costs: _containers.RepeatedCompositeFieldContainer[TierFetchCost]
    kv_block_bytes: int
    remote_tier: bool
    loras: _containers.RepeatedScalarFieldContainer[str]
    resident_loras: _containers.RepeatedScalarFieldContainer[str]
    max_num_seqs: int
    def __init__(self, worker_id: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., unix_ms: _Optional[int] = ..., queue_wait_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ..., max_num_waiting: _Optional[int] = ..., incarnation: _Optional[int] = ..., kv_seq: _Optional[int] = ..., step_fixed_s: _Optional[float] = ..., step_token_s: _Optional[float] = ..., step_row_s: _Optional[float] = ..., step_token_budget: _Optional[int] = ..., fetch_costs: _Optional[_Iterable[_Union[TierFetchCost, _Mapping]]] = ..., kv_block_bytes: _Optional[int] = ..., remote_tier: _Optional[bool] = ..., loras: _Optional[_Iterable[str]] = ..., resident_loras: _Optional[_Iterable[str]] = ..., max_num_seqs: _Optional[int] = ...) -> None: ...

class TierFetchCost(_message.Message):
    __slots__ = ("tier", "fixed_s", "byte_s")
    TIER_FIELD_NUMBER: _ClassVar[int]
    FIXED_S_FIELD_NUMBER: _ClassVar[int]
    BYTE_S_FIELD_NUMBER: _ClassVar[int]
    tier: str
    fixed_s: float
    byte_s: float
    def __init__(self, tier: _Optional[str] = ..., fixed_s: _Optional[float] = ..., byte_s: _Optional[float] = ...) -> None: ...

class RouteCharges(_message.Message):
    __slots__ = ("master_id", "charges")
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    CHARGES_FIELD_NUMBER: _ClassVar[int]
    master_id: str
    charges: _containers.RepeatedCompositeFieldContainer[RouteCharge]
    def __init__(self, master_id: _Optional[str] = ..., charges: _Optional[_Iterable[_Union[RouteCharge, _Mapping]]] = ...) -> None: ...

class RouteCharge(_message.Message):
    __slots__ = ("worker_id", "tokens", "blocks", "unix_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    tokens: int
    blocks: int
    unix_ms: int
    def __init__(self, worker_id: _Optional[str] = ..., tokens: _Optional[int] = ..., blocks: _Optional[int] = ..., unix_ms: _Optional[int] = ...) -> None: ...
