"""`rtp-serve cache`: one cache service instance (remote-memory KV tier, optionally over Redis).

Must stay importable without torch: it runs on CPU-only nodes next to Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from rtp_serve.services.cache import metrics as cache_metrics
from rtp_serve.services.cache.kv_feed import CacheEventFeed
from rtp_serve.services.cache.lru import ByteLRU
from rtp_serve.services.cache.redis_keys import RedisKeys
from rtp_serve.services.cache.redis_tier import DEFAULT_TTL_S, RedisTier
from rtp_serve.services.cache.servicer import CacheServicer
from rtp_serve.services.common import grpc_util, metrics
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.env import env
from rtp_serve.services.common.flags import add_common_flags, advertised, redact
from rtp_serve.services.common.heap import keep_freed_memory
from rtp_serve.services.common.pb import cache_pb2, cache_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["Cache"].full_name


def add_arguments(p: argparse.ArgumentParser, name: str = "cache") -> None:
    add_common_flags(p)
    p.add_argument(
        "--capacity-mib",
        type=int,
        default=int(env("cache_capacity_mib", "512")),
        help="bytes of KV blocks held in memory, in MiB",
    )
    p.add_argument(
        "--redis-url",
        default=env("redis_url"),
        help="redis://host:port of the storage tier (optional; without it: memory only)",
    )
    p.add_argument(
        "--redis-password",
        default=env("redis_password"),
        help="Redis AUTH password (its requirepass); never logged",
    )
    p.add_argument(
        "--redis-ttl-s",
        type=int,
        default=int(env("redis_ttl_s", str(DEFAULT_TTL_S))),
        help="seconds a block lives in Redis after it was written",
    )


async def serve(args: argparse.Namespace) -> None:
    if args.capacity_mib <= 0:
        raise ValueError(f"--capacity-mib must be positive, got {args.capacity_mib}")
    keep_freed_memory()  # blocks of megabytes arrive, are copied and stored (common/heap.py)
    redis = (
        RedisTier(
            args.redis_url, args.namespace, ttl_s=args.redis_ttl_s, password=args.redis_password
        )
        if args.redis_url
        else None
    )
    # A member with NATS: the in-memory tier's changes feed the master's index (kv_feed.py).
    indexed = bool(args.nats_url and args.nameservice)
    servicer = CacheServicer(ByteLRU(args.capacity_mib << 20, record_events=indexed), redis)
    server, port, health = grpc_util.create_server(f"{args.host}:{args.port}")
    cache_pb2_grpc.add_CacheServicer_to_server(servicer, server)
    address = advertised(args, port)
    lru = servicer.lru
    cache_metrics.cache_service().watch_memory(lambda: lru.bytes_used, lambda: len(lru))
    metrics_address = advertised(args, metrics.start_metrics_server(args.metrics_port, args.host))
    names = bus = None
    tasks: list[asyncio.Task[None]] = []  # the index feed's loops
    try:
        await server.start()
        await grpc_util.set_serving(health, SERVICE_NAME, True)
        log.info(
            "cache serving on %s: %d MiB in memory, redis %s",
            address,
            args.capacity_mib,
            redact(args.redis_url) if args.redis_url else "off",
        )
        if args.nameservice:
            # Imported here: the nameservice is optional, and so is its client module.
            from rtp_serve.services.common.naming import NameClient, make_member
            from rtp_serve.services.common.pb import nameservice_pb2

            names = NameClient(args.nameservice)
            member = make_member(
                nameservice_pb2.ROLE_CACHE, address, metrics_address=metrics_address
            )
            if indexed:
                bus = await Bus.connect(args.nats_url, member.id, args.nats_token)
                if redis is not None:
                    servicer.redis_keys = RedisKeys(redis)
                    tasks.append(asyncio.create_task(servicer.redis_keys.run(), name="t3"))
                servicer.feed = CacheEventFeed(
                    lru, bus, member.id, args.namespace, redis_keys=servicer.redis_keys
                )
                tasks.append(asyncio.create_task(servicer.feed.run(), name="kv-feed"))
            await names.register(member)
        await server.wait_for_termination()
    finally:
        await grpc_util.set_serving(health, SERVICE_NAME, False)
        for task in tasks:
            task.cancel()
        if names is not None:
            await names.close()
        if bus is not None:
            await bus.close()
        await server.stop(grace=0.5)
        await servicer.close()
        if redis is not None:
            await redis.close()
        lru = servicer.lru
        log.info(
            "cache stopped: %d blocks, %d hits, %d misses, %d evictions, %d promoted",
            len(lru),
            lru.stats.hits,
            lru.stats.misses,
            lru.stats.evictions,
            servicer.promoted,
        )
