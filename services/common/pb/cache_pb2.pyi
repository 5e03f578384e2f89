from rtp_serve.services.common.pb import common_pb2 as _common_pb2
from rtp_serve.services.common.pb import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutRequest(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.KVBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[_common_pb2.KVBlock, _Mapping]]] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetReply(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[_common_pb2.KVBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[_common_pb2.KVBlock, _Mapping]]] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExistsReply(_message.Message):
    __slots__ = ("num_prefix",)
    NUM_PREFIX_FIELD_NUMBER: _ClassVar[int]
    num_prefix: int
    def __init__(self, num_prefix: _Optional[int] = ...) -> None: ...
