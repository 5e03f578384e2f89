from rtp_serve.services.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority", "prefill_address", "block_hashes", "structured", "lora_name", "tenant", "remote_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    priority: int
    prefill_address: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    structured: StructuredOutput
    lora_name: str
    tenant: Tenant
    remote_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., prefill_address: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., lora_name: _Optional[str] = ..., tenant: _Optional[_Union[Tenant, _Mapping]] = ..., remote_blocks: _Optional[int] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("name", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "resume_tokens")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKENS_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    resume_tokens: int
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., resume_tokens: _Optional[int] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finished", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "stop_reason", "queue_s", "prefill_s")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finished: bool
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    stop_reason: int
    queue_s: float
    prefill_s: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., stop_reason: _Optional[int] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority", "skip_blocks", "block_hashes", "structured", "lora_name", "tenant", "remote_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    priority: int
    skip_blocks: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    structured: StructuredOutput
    lora_name: str
    tenant: Tenant
    remote_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., skip_blocks: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., lora_name: _Optional[str] = ..., tenant: _Optional[_Union[Tenant, _Mapping]] = ..., remote_blocks: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first", "block")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    first: GenerateResponse
    block: _common_pb2.KVBlock
    def __init__(self, first: _Optional[_Union[GenerateResponse, _Mapping]] = ..., block: _Optional[_Union[_common_pb2.KVBlock, _Mapping]] = ...) -> None: ...

class WorkerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("num_waiting", "num_running", "free_blocks", "total_blocks", "held_blocks", "integrity_ok", "integrity_error", "block_size", "queued_tokens", "queue_wait_s", "prefill_tokens_per_s", "decode_step_s", "max_num_waiting", "dtype", "weight_dtype", "kv_dtype", "cpu_isa", "linear_kernels", "loras", "resident_loras", "attention_backend", "kv_transfers_in_flight")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_OK_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CPU_ISA_FIELD_NUMBER: _ClassVar[int]
    LINEAR_KERNELS_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LORAS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    free_blocks: int
    total_blocks: int
    held_blocks: int
    integrity_ok: bool
    integrity_error: str
    block_size: int
    queued_tokens: int
    queue_wait_s: float
    prefill_tokens_per_s: float
    decode_step_s: float
    max_num_waiting: int
    dtype: str
    weight_dtype: str
    kv_dtype: str
    cpu_isa: str
    linear_kernels: str
    loras: _containers.RepeatedScalarFieldContainer[str]
    resident_loras: _containers.RepeatedScalarFieldContainer[str]
    attention_backend: str
    kv_transfers_in_flight: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., held_blocks: _Optional[int] = ..., integrity_ok: _Optional[bool] = ..., integrity_error: _Optional[str] = ..., block_size: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., queue_wait_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ..., max_num_waiting: _Optional[int] = ..., dtype: _Optional[str] = ..., weight_dtype: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., cpu_isa: _Optional[str] = ..., linear_kernels: _Optional[str] = ..., loras: _Optional[_Iterable[str]] = ..., resident_loras: _Optional[_Iterable[str]] = ..., attention_backend: _Optional[str] = ..., kv_transfers_in_flight: _Optional[int] = ...) -> None: ...

class KVSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVSnapshot(_message.Message):
    __slots__ = ("worker_id", "incarnation", "seq", "block_hashes", "host_block_hashes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    host_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., host_block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LoadLoraRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoraReply(_message.Message):
    __slots__ = ("loras",)
    LORAS_FIELD_NUMBER: _ClassVar[int]
    loras: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, loras: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamsRequest(_message.Message):
    __slots__ = ("open", "cancel", "timeout_s", "trace")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    open: GenerateRequest
    cancel: str
    timeout_s: float
    trace: _containers.ScalarMap[str, str]
    def __init__(self, open: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[str] = ..., timeout_s: _Optional[float] = ..., trace: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StreamsReply(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[StreamOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[StreamOutput, _Mapping]]] = ...) -> None: ...

class StreamOutput(_message.Message):
    __slots__ = ("request_id", "response", "code", "details", "failed_peer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    FAILED_PEER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: GenerateResponse
    code: int
    details: str
    failed_peer: str
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., failed_peer: _Optional[str] = ...) -> None: ...
