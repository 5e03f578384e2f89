"""The LoRA adapters this frontend serves as models: `model: NAME` selects one.

The frontend reads each adapter's directory once (torch-free: core/peft_config.py) for the
content fingerprint that salts its block hashes, with the base model's salt parts the
workers registered (KVNamespace.salt), exactly as the workers' engines do, so cache-aware
routing matches each adapter's own KV namespace. Adapters come from
--lora flags (given to the workers alike) and from the admin endpoints, which fan the change
out to every worker (Worker.LoadLoraAdapter / UnloadLoraAdapter) before it takes effect here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from rtp_serve.core.peft_config import AdapterError, LoraConfig, check_name
from rtp_serve.services.common.naming import WORKER_ROLES
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from rtp_serve.services.common.pb import worker_pb2, worker_pb2_grpc
from rtp_serve.services.frontend.errors import ErrorKind, FrontendError, invalid

log = logging.getLogger(__name__)

ADMIN_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str
    fingerprint: str  # content hash (hex): with the base model's, it salts its requests
    created: int  # unix seconds, for /v1/models


class Adapters:
    def __init__(self, root: str | Path | None = None) -> None:
        """`root` (--lora-root): the only directory the admin endpoint loads adapters from;
        None: loading at run time is refused."""
        self._by_name: dict[str, Adapter] = {}
        self.root = None if root is None else Path(root).resolve()

    def under_root(self, path: str) -> str:
        """`path` (relative to the root, or absolute) resolved, symlinks and `..` included;
        FrontendError 403 naming lora_path if that is not inside the root, or there is none."""
        if self.root is None:
            raise FrontendError(
                ErrorKind.FORBIDDEN,
                "loading LoRA adapters at run time is disabled: the frontend needs --lora-root",
                "lora_path",
                "forbidden",
            )
        try:
            resolved = (self.root / path).resolve()  # an absolute path replaces the root
        except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL byte
            raise invalid(f"lora_path cannot be resolved: {exc}", "lora_path") from None
        if not resolved.is_relative_to(self.root):
            raise FrontendError(
                ErrorKind.FORBIDDEN,
                "lora_path is outside the adapter root (--lora-root) once resolved",
                "lora_path",
                "forbidden",
            )
        return str(resolved)

    def __iter__(self):
        return iter(sorted(self._by_name.values(), key=lambda a: a.name))

    def get(self, name: str) -> Adapter | None:
        return self._by_name.get(name)

    def add(self, name: str, path: str) -> Adapter:
        """Read and register (AdapterError: not a servable PEFT adapter)."""
        cfg = LoraConfig.load(name, path)
        adapter = Adapter(name, cfg.path, cfg.fingerprint, int(time.time()))
        self._by_name[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        self._by_name.pop(name, None)

    def load_flags(self, loras: Iterable[tuple[str, str]]) -> None:
        for name, path in loras:
            self.add(name, path)
            log.info("serving LoRA adapter %s from %s", name, path)


async def fan_out(
    channels, members: list[ns_pb2.Member], call: str, request
) -> list[tuple[ns_pb2.Member, grpc.aio.AioRpcError | None]]:
    """Call `call` (LoadLoraAdapter / UnloadLoraAdapter) on every worker, concurrently."""

    async def one(member: ns_pb2.Member):
        stub = worker_pb2_grpc.WorkerStub(channels(member.address))
        try:
            await getattr(stub, call)(request, timeout=ADMIN_TIMEOUT_S)
            return member, None
        except grpc.aio.AioRpcError as exc:
            return member, exc

    return list(await asyncio.gather(*(one(m) for m in members)))


async def load_adapter(adapters: Adapters, router, name: str, path: str) -> Adapter:
    """Check the adapter here, load it on every worker, then serve it; raises FrontendError
    (400 a bad adapter, 503 no workers, or what the first failing worker said)."""
    try:
        check_name(name)
        LoraConfig.load(name, path)  # fails here, before any worker loads a bad one
    except AdapterError as exc:
        raise invalid(str(exc), "lora_path") from None
    members = _workers(router)
    request = worker_pb2.LoadLoraRequest(lora_name=name, lora_path=path)
    _raise_first(await fan_out(router.channel, members, "LoadLoraAdapter", request), name)
    adapter = adapters.add(name, path)
    log.info("LoRA adapter %s loaded from %s on %d workers", name, path, len(members))
    return adapter


async def unload_adapter(adapters: Adapters, router, name: str) -> None:
    if adapters.get(name) is None:
        raise not_found(name, "lora_name")
    members = _workers(router)
    request = worker_pb2.UnloadLoraRequest(lora_name=name)
    results = await fan_out(router.channel, members, "UnloadLoraAdapter", request)
    # A worker that never had it (started later, without the flag) is already done.
    _raise_first(
        [(m, e) for m, e in results if e is None or e.code() != grpc.StatusCode.NOT_FOUND], name
    )
    adapters.remove(name)
    log.info("LoRA adapter %s unloaded from %d workers", name, len(members))


def not_found(name: str, param: str = "model") -> FrontendError:
    return FrontendError(
        ErrorKind.NOT_FOUND, f"The model `{name}` does not exist.", param, "model_not_found"
    )


def _workers(router) -> list[ns_pb2.Member]:
    members = [m for role in sorted(WORKER_ROLES) for m in router.membership.with_role(role)]
    if not members:
        raise FrontendError(
            ErrorKind.UNAVAILABLE, "no worker is registered to load the adapter on",
            code="service_unavailable",
        )  # fmt: skip
    return members


def _raise_first(results, name: str) -> None:
    for member, exc in results:
        if exc is None:
            continue
        who = member.id or member.address
        code = exc.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise invalid(f"worker {who}: {exc.details()}", "lora_path")
        if code == grpc.StatusCode.NOT_FOUND:
            raise not_found(name, "lora_name")
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            raise FrontendError(ErrorKind.CONFLICT, f"worker {who}: {exc.details()}", "lora_name")
        raise FrontendError(
            ErrorKind.UNAVAILABLE, f"worker {who}: {code.name} {exc.details()}",
            code="service_unavailable",
        )  # fmt: skip
