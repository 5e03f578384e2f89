"""Mutual TLS checks shared by the TLS tests: who gets through to an internal gRPC service.

`probe(address, role, tls)` makes one real call of that service's own API; `assert_members_only`
shows that a plaintext client, a TLS client without a certificate and one whose certificate
another CA signed are all refused, and a member's certificate is served.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.pb import (
    cache_pb2,
    cache_pb2_grpc,
    master_pb2,
    master_pb2_grpc,
    nameservice_pb2,
    nameservice_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from rtp_serve.services.common.tls import TlsConfig
from rtp_serve.services.launcher.certs import CertFiles, issue_cluster_certs


def load(files: CertFiles) -> TlsConfig:
    return TlsConfig.load(str(files.cert), str(files.key), str(files.ca))


def issue(tmp: Path, name: str) -> TlsConfig:
    return load(issue_cluster_certs(tmp / name, name))


def tls_flags(files: CertFiles) -> tuple[str, ...]:
    return ("--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca))


async def _call(channel: grpc.aio.Channel, role: str) -> None:
    if role == "nameservice":
        stub = nameservice_pb2_grpc.NameServiceStub(channel)
        await stub.List(nameservice_pb2.ListRequest(), timeout=5)
    elif role == "master":
        await master_pb2_grpc.MasterStub(channel).Index(master_pb2.IndexRequest(), timeout=5)
    elif role == "cache":
        stub = cache_pb2_grpc.CacheStub(channel)
        await stub.Exists(cache_pb2.ExistsRequest(block_hashes=[b"k" * 16]), timeout=5)
    elif role == "worker":
        await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.WorkerStatsRequest(), timeout=5)
    else:
        raise ValueError(role)


def probe(address: str, role: str, tls: TlsConfig | None) -> None:
    """One call of `role`'s API at `address`, as a member holding `tls` (None: plaintext)."""

    async def run() -> None:
        async with grpc_util.channel(address, tls) as ch:
            await _call(ch, role)

    asyncio.run(run())


def probe_without_certificate(address: str, role: str, ca: bytes) -> None:
    """A TLS client that trusts the cluster CA but has no certificate of its own."""

    async def run() -> None:
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
        async with grpc.aio.secure_channel(address, creds) as ch:
            await _call(ch, role)

    asyncio.run(run())


def assert_members_only(address: str, role: str, member: TlsConfig, foreign: TlsConfig) -> None:
    probe(address, role, member)  # a member is served
    refused = [
        lambda: probe_plaintext(address, role),
        lambda: probe_without_certificate(address, role, member.ca),
        lambda: probe(address, role, foreign),
        # A foreign certificate, even when the client trusts the cluster's CA for the server.
        lambda: probe(address, role, TlsConfig(foreign.cert, foreign.key, member.ca)),
    ]
    for attempt in refused:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            attempt()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (role, err.value)


def probe_plaintext(address: str, role: str) -> None:
    async def run() -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            await _call(ch, role)

    asyncio.run(run())
