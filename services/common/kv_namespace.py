"""The KV namespace of a served model: what its block hash keys depend on besides the tokens
(block size and cache salt). Workers register it with the nameservice; the frontend learns
it from there and hashes prompts with it, so no flag has to agree between the two."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rtp_serve.core.block_hash import BlockHash, block_hash_keys, salt_of
from rtp_serve.services.common.pb import nameservice_pb2 as pb


@dataclass(frozen=True, slots=True)
class KVNamespace:
    block_size: int
    model_id: str  # core.block_hash.model_fingerprint(model).hex()
    kv_numerics: str  # core.dtypes.kv_numerics(dtype, weight_dtype, kv_dtype)

    @property
    def cache_salt(self) -> bytes:
        """The base model's salt, as the engine's `cache_salt`."""
        return salt_of(self.model_id, self.kv_numerics)

    def salt(self, adapter: str = "") -> bytes:
        """The salt of a LoRA adapter's requests (`adapter`: its fingerprint, hex)."""
        return salt_of(self.model_id, self.kv_numerics, adapter)

    def keys(self, token_ids: Sequence[int], adapter: str = "") -> list[BlockHash]:
        return block_hash_keys(token_ids, self.block_size, self.salt(adapter))

    def stamp(self, member: pb.Member) -> pb.Member:
        """`member` carrying this namespace (in place; returned for chaining)."""
        member.block_size = self.block_size
        member.cache_salt = self.cache_salt
        member.model_id = self.model_id
        member.kv_numerics = self.kv_numerics
        return member

    @classmethod
    def of(cls, member: pb.Member) -> KVNamespace | None:
        """The namespace `member` registered; None where it carries none (not a worker) or
        one whose parts do not make its salt (a member of another build: ignored)."""
        if not member.block_size or not member.cache_salt:
            return None
        ns = cls(member.block_size, member.model_id, member.kv_numerics)
        return ns if ns.cache_salt == member.cache_salt else None
