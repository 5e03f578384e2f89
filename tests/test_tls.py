"""Mutual TLS on internal gRPC: only holders of a certificate from the cluster CA get in.

Real nameservice, master and cache processes started with --tls-*; the master and the cache
register with the nameservice over mTLS (their client side), and every one of them refuses
plaintext, certificate-less and foreign-CA clients. Workers: tests/test_security_cluster.py.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.pb import nameservice_pb2, nameservice_pb2_grpc
from rtp_serve.services.common.tls import TlsConfig
from rtp_serve.services.launcher.certs import issue_cluster_certs
from tests import procs
from tests.mtls import assert_members_only, issue, load, tls_flags


def test_in_process_server_needs_a_member_certificate(tmp_path):
    member, foreign = issue(tmp_path, "cluster"), issue(tmp_path, "other")

    async def run() -> None:
        server, port, health = grpc_util.create_server("127.0.0.1:0", tls=member)
        await server.start()
        try:
            address = f"127.0.0.1:{port}"
            assert await grpc_util.check_health(address, tls=member)
            assert not await grpc_util.check_health(address, tls=foreign)
            async with grpc.aio.insecure_channel(address) as ch:
                with pytest.raises(grpc.aio.AioRpcError):
                    await ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=2)
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_config_needs_all_three_files(tmp_path):
    files = issue_cluster_certs(tmp_path)
    assert TlsConfig.load(None, None, None) is None
    with pytest.raises(ValueError, match="all of"):
        TlsConfig.load(str(files.cert), str(files.key), None)
    config = TlsConfig.load(str(files.cert), str(files.key), str(files.ca), "rtp.internal")
    assert config.channel_options() == [("grpc.ssl_target_name_override", "rtp.internal")]


def test_every_control_plane_service_refuses_non_members(tmp_path):
    files = issue_cluster_certs(tmp_path / "cluster")
    member, foreign = load(files), issue(tmp_path, "other")
    flags = tls_flags(files)
    with procs.grpc_service("nameservice", *flags, tls=member) as (ns, _):
        common = (*flags, "--nameservice", ns)
        with (
            procs.grpc_service("master", *common, tls=member) as (master, _),
            procs.grpc_service("cache", *common, "--capacity-mib", "1", tls=member) as (cache, _),
        ):
            _wait_registered(ns, member, 2)  # both called the nameservice with their certs
            for address, role in ((ns, "nameservice"), (master, "master"), (cache, "cache")):
                assert_members_only(address, role, member, foreign)


def _wait_registered(ns: str, tls: TlsConfig, n: int, timeout: float = 30.0) -> None:
    async def count() -> int:
        async with grpc_util.channel(ns, tls) as ch:
            reply = await nameservice_pb2_grpc.NameServiceStub(ch).List(
                nameservice_pb2.ListRequest(), timeout=5
            )
        return len(reply.members)

    deadline = time.monotonic() + timeout
    while asyncio.run(count()) < n:
        assert time.monotonic() < deadline, "members never registered over mTLS"
        time.sleep(0.1)
