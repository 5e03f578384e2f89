"""The KV namespace (block size, cache salt) the workers register: the nameservice refuses a
worker whose namespace differs from its model's other workers', and the frontend hashes
prompts in the namespace it learnt from them, with no numerics flags of its own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rtp_serve.core.block_hash import block_hash_keys, cache_salt, model_fingerprint
from rtp_serve.core.dtypes import kv_numerics
from rtp_serve.services.common.kv_namespace import KVNamespace
from rtp_serve.services.common.naming import NameClient
from rtp_serve.services.common.pb import master_pb2_grpc
from rtp_serve.services.common.pb import nameservice_pb2 as pb
from rtp_serve.services.launcher.servers import free_port
from rtp_serve.services.master.packed_hashes import route_hashes
from rtp_serve.services.nameservice.registry import NamespaceConflict, Registry
from tests.frontend_fakes import FakeMaster, serve_grpc
from tests.procs import grpc_service, spawn, stop, wait_grpc
from tests.servers import eventually

FUSED = pb.ROLE_FUSED
WORKER_FLAGS = ("--threads", "1", "--kv-cache-mib", "16")
BF16_KV = kv_numerics("float32", "auto", "bfloat16")  # tiny-llama computes in float32
BLOCK = 8  # not the default 16


def _worker(member_id: str, kv: KVNamespace, model: str = "m") -> pb.Member:
    return kv.stamp(pb.Member(id=member_id, role=FUSED, address=f"{member_id}:1", model=model))


def test_registry_refuses_a_worker_of_another_namespace() -> None:
    reg = Registry(ttl=3.0)
    base = KVNamespace(16, "ab" * 16, "float32")
    first = _worker("w1", base)
    reg.register(first)
    reg.register(_worker("w2", base))  # the same namespace: welcome
    for odd in (KVNamespace(16, base.model_id, BF16_KV), KVNamespace(32, base.model_id, "float32")):
        with pytest.raises(NamespaceConflict) as info:
            reg.register(_worker("w3", odd))
        message = str(info.value)
        assert base.cache_salt.hex() in message and odd.cache_salt.hex() in message
        assert "w3" in message and "w1" in message
    assert "w3" not in reg
    # Members without a namespace (frontend, master, cache) and workers of another model pass.
    reg.register(pb.Member(id="f1", role=pb.ROLE_FRONTEND, model="m"))
    reg.register(_worker("x1", KVNamespace(16, base.model_id, BF16_KV), model="other"))
    # A worker alone in its model may come back (same id) with another namespace.
    reg.register(_worker("x1", KVNamespace(32, base.model_id, BF16_KV), model="other"))


def _logged(path: Path, name: str, *flags: str) -> subprocess.Popen:
    """A service process whose stderr (its log) goes to `path`."""
    argv = [sys.executable, "-m", "rtp_serve.services.cli", name, *flags]
    with open(path, "w") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=log, env=os.environ)


async def _member(nameservice: str, member_id: str) -> pb.Member:
    async with NameClient(nameservice) as names:
        for _ in range(200):
            found = [m for m in await names.list() if m.id == member_id]
            if found:
                return found[0]
            await asyncio.sleep(0.05)
    raise AssertionError(f"{member_id} never registered")


def test_workers_register_their_namespace_and_the_frontend_hashes_in_it(model_dir, tmp_path):
    """Workers with --kv-dtype bfloat16 --block-size 8: the frontend, given neither, sends
    the master the keys those workers compute (the old defaults would be wrong twice), the
    repeated prompt hits the prefix cache, and a worker of the default namespace is refused
    by the nameservice (whose log names both salts and both workers) and exits non-zero."""
    model = str(model_dir("tiny-llama"))
    ours = cache_salt(model, BF16_KV)
    default = cache_salt(model, "float32")
    port = free_port()
    nameservice = f"127.0.0.1:{port}"
    ns_log = tmp_path / "nameservice.log"
    ns = _logged(ns_log, "nameservice", "--port", str(port), "--ttl", "1")
    try:
        wait_grpc(nameservice, ns, 20)
        flags = ("--nameservice", nameservice, "--model", model, *WORKER_FLAGS)
        numerics = ("--kv-dtype", "bfloat16", "--block-size", str(BLOCK))
        with grpc_service("fused", *flags, *numerics, "--worker-id", "w-bf16"):
            member = asyncio.run(_member(nameservice, "w-bf16"))
            assert KVNamespace.of(member) == KVNamespace(
                BLOCK, model_fingerprint(model).hex(), BF16_KV
            )
            assert member.cache_salt == ours

            odd_log = tmp_path / "odd.log"
            odd_port = str(free_port())
            odd = _logged(odd_log, "fused", "--port", odd_port, *flags, "--worker-id", "w-f32")
            try:
                assert odd.wait(120) != 0, "a refused worker must not serve"
            finally:
                stop(odd)
            assert "refused" in odd_log.read_text()
            (line,) = [ln for ln in ns_log.read_text().splitlines() if "refused" in ln]
            assert all(s in line for s in (ours.hex(), default.hex(), "w-bf16", "w-f32")), line

            cached = asyncio.run(_through_the_frontend(model, nameservice, member))
    finally:
        assert stop(ns) == 0
    assert cached > 0


async def _through_the_frontend(model: str, nameservice: str, worker: pb.Member) -> int:
    """The same prompt twice through a frontend process (its master scripted here, to see
    its keys); the second answer's cached tokens."""
    master = FakeMaster([(worker.id, None)])
    master.members = {worker.id: worker}
    server, master_address = await serve_grpc(master_pb2_grpc.add_MasterServicer_to_server, master)
    port = free_port()
    frontend = spawn("frontend", "--nameservice", nameservice, "--master", master_address,
                     "--model", model, "--port", str(port))  # fmt: skip
    prompt = list(range(10, 50))  # 40 tokens: 5 blocks of 8 (2 of 16)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:

            async def ready() -> bool:
                try:
                    return (await http.get("/ready")).status_code == 200
                except httpx.TransportError:
                    return False

            await eventually(ready, 30.0, "the frontend knows the worker")
            usages = []
            for _ in range(2):
                body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 2}
                reply = await http.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                usages.append(reply.json()["usage"])
    finally:
        await asyncio.to_thread(stop, frontend)
        await server.stop(None)
    keys = block_hash_keys(prompt, BLOCK, cache_salt(model, BF16_KV))
    assert len(keys) == 5
    assert [list(route_hashes(r)) for r in master.requests] == [keys, keys]
    return usages[1]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("flag", ["--dtype", "--weight-dtype", "--kv-dtype", "--block-size"])
def test_model_numerics_are_worker_and_launcher_flags_only(flag, capsys) -> None:
    """Declared once (flags.add_model_flags): the workers and the launcher take them, the
    frontend, which learns them from the workers, refuses them."""
    from rtp_serve.services.cli import build_parser

    value = {"--block-size": "8", "--weight-dtype": "int8"}.get(flag, "bfloat16")
    for service in ("fused", "prefill", "decode", "up"):
        argv = [service, f"{flag}={value}"]
        args = build_parser(argv).parse_args(argv)
        assert str(getattr(args, flag[2:].replace("-", "_"))) == value
    argv = ["frontend", "--model", "m", f"{flag}={value}"]
    with pytest.raises(SystemExit) as info:
        build_parser(argv).parse_args(argv)
    assert info.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err
