"""NATS with a token and Redis with a password, as the launcher starts them: a client
without the secret is refused, one with it works (through our Bus and RedisTier), and the
secret never shows on the server's command line."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import nats as nats_py
import pytest
import redis.asyncio as aioredis
from nats.errors import NoServersError
from redis.exceptions import AuthenticationError, ResponseError

from rtp_serve.services.cache.redis_tier import RedisTier
from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import events_pb2
from tests.servers import eventually, nats, redis

TOKEN = "s3cret-nats-token"
PASSWORD = "s3cret-redis-password"


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_nats_with_a_token_refuses_a_client_without_it(tmp_path, caplog):
    async def refused(url: str, **auth: str) -> None:
        nc = nats_py.NATS()
        with pytest.raises((NoServersError, nats_py.errors.Error, OSError)):
            await nc.connect(url, allow_reconnect=False, max_reconnect_attempts=0, **auth)
        assert not nc.is_connected
        await nc.close()

    async def main(url: str) -> None:
        await refused(url)
        await refused(url, token="wrong")
        sub, pub = await Bus.connect(url, "sub", TOKEN), await Bus.connect(url, "pub", TOKEN)
        assert sub.connected and pub.connected
        got: asyncio.Queue[events_pb2.LoadReport] = asyncio.Queue()

        async def handler(msg: events_pb2.LoadReport, headers: dict[str, str]) -> None:
            await got.put(msg)

        subject = subjects.load_report("w1", namespace="authtest")
        await sub.subscribe(subject, events_pb2.LoadReport, handler)
        await pub.publish(subject, events_pb2.LoadReport(worker_id="w1"))
        assert (await asyncio.wait_for(got.get(), 5)).worker_id == "w1"
        await sub.close()
        await pub.close()
        without = await Bus.connect(url, "without")  # degrades (never connects), never raises
        assert not without.connected
        await without.close()
        # ...but says why, as an error: a missing token is no outage that retrying ends.
        errors = [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.ERROR and r.name == "rtp_serve.services.common.bus"
        ]
        assert errors and "without" in errors[0] and "--nats-token" in errors[0], caplog.text

    with nats(tmp_path, token=TOKEN) as proc:
        assert TOKEN not in _cmdline(proc.pid)
        asyncio.run(main(proc.url))


def test_redis_with_a_password_refuses_a_client_without_it(tmp_path):
    async def main(url: str) -> None:
        for password in (None, "wrong"):
            client = aioredis.Redis.from_url(url, password=password)
            with pytest.raises((AuthenticationError, ResponseError)):
                await client.set("k", b"v")
            await client.aclose()
        tier = RedisTier(url, "authtest", password=PASSWORD)
        assert await tier.put_many([(b"h" * 16, b"payload")])
        assert await tier.get_many([b"h" * 16]) == [b"payload"]
        await tier.close()
        unauthorised = RedisTier(url, "authtest", retry_after_s=0.05)
        assert await unauthorised.get_many([b"h" * 16]) == [None]  # a miss, not a crash
        await eventually(lambda: unauthorised.failures > 0, what="the refusal counted")
        await unauthorised.close()

    with redis(tmp_path, password=PASSWORD) as proc:
        assert PASSWORD not in _cmdline(proc.pid)
        asyncio.run(main(proc.url))
