from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_FRONTEND: _ClassVar[Role]
    ROLE_MASTER: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_FUSED: _ClassVar[Role]
    ROLE_CACHE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_FRONTEND: Role
ROLE_MASTER: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_FUSED: Role
ROLE_CACHE: Role

class Member(_message.Message):
    __slots__ = ("id", "role", "address", "model", "capacity", "metrics_address", "block_size", "cache_salt", "model_id", "kv_numerics", "streams")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    KV_NUMERICS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: Role
    address: str
    model: str
    capacity: int
    metrics_address: str
    block_size: int
    cache_salt: bytes
    model_id: str
    kv_numerics: str
    streams: bool
    def __init__(self, id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., capacity: _Optional[int] = ..., metrics_address: _Optional[str] = ..., block_size: _Optional[int] = ..., cache_salt: _Optional[bytes] = ..., model_id: _Optional[str] = ..., kv_numerics: _Optional[str] = ..., streams: _Optional[bool] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("ttl_ms",)
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    def __init__(self, ttl_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: Role
    def __init__(self, role: _Optional[_Union[Role, str]] = ...) -> None: ...

class MemberList(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    def __init__(self, members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MembershipEvent(_message.Message):
    __slots__ = ("kind", "member", "reason")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[MembershipEvent.Kind]
        KIND_JOINED: _ClassVar[MembershipEvent.Kind]
        KIND_LEFT: _ClassVar[MembershipEvent.Kind]
        KIND_SNAPSHOT: _ClassVar[MembershipEvent.Kind]
    KIND_UNSPECIFIED: MembershipEvent.Kind
    KIND_JOINED: MembershipEvent.Kind
    KIND_LEFT: MembershipEvent.Kind
    KIND_SNAPSHOT: MembershipEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: MembershipEvent.Kind
    member: Member
    reason: str
    def __init__(self, kind: _Optional[_Union[MembershipEvent.Kind, str]] = ..., member: _Optional[_Union[Member, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...
