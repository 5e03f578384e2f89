"""`rtp-serve master`: the global scheduler service (docs/design.md "The request path", step 3).

It follows the nameservice membership stream and, with --nats-url, every worker's KV events
and load reports; Route answers from that view. Without NATS it still routes, by membership
alone (no prefix or load information). Never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os

from prometheus_client import REGISTRY

from rtp_serve.services.common import grpc_util, metrics
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.env import env
from rtp_serve.services.common.flags import add_common_flags, advertised
from rtp_serve.services.common.naming import NameClient, make_member
from rtp_serve.services.common.pb import master_pb2_grpc, nameservice_pb2
from rtp_serve.services.master import block_ids
from rtp_serve.services.master.charge_exchange import ChargeExchange
from rtp_serve.services.master.cluster import ClusterView, SnapshotClient
from rtp_serve.services.master.metrics import IndexSizeCollector
from rtp_serve.services.master.policy import POLICIES, make_policy
from rtp_serve.services.master.servicer import MasterServicer

log = logging.getLogger(__name__)

# Below this many uncached prompt tokens a PD cluster prefills on the decode worker
# (measured on one 2-core box with llama-100m; see the serving issue's closing note).
DEFAULT_MAX_LOCAL_PREFILL_TOKENS = 1024

SERVICE_NAME = "rtp.v1.Master"


def add_arguments(p: argparse.ArgumentParser, name: str = "master") -> None:
    add_common_flags(p)
    p.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=env("policy", "cache_aware"),
        help="routing policy",
    )
    p.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=int(env("max_local_prefill_tokens", str(DEFAULT_MAX_LOCAL_PREFILL_TOKENS))),
        help="PD mode: a prompt with fewer uncached tokens is computed by its decode worker "
        "(conditional disaggregation); 0 sends every prompt to a prefill worker",
    )
    p.add_argument(
        "--event-cutoff-ms",
        type=float,
        default=float(env("event_cutoff_ms", "0")),
        help="count each event (load report, KV batch, another replica's route charge) "
        "this long after its stamp, and route each request on the events stamped that long "
        "before it: master replicas asked the same then choose alike (their clocks "
        "synchronized); 0: on arrival",
    )


async def serve(args: argparse.Namespace) -> None:
    """Run the master until cancelled."""
    if args.event_cutoff_ms < 0:
        raise SystemExit("--event-cutoff-ms must be >= 0")
    view = ClusterView(event_cutoff_s=args.event_cutoff_ms / 1000)
    REGISTRY.register(IndexSizeCollector(view.index.sizes, asyncio.get_running_loop()))
    if args.max_local_prefill_tokens < 0:
        raise SystemExit("--max-local-prefill-tokens must be >= 0")
    policy = make_policy(args.policy, args.max_local_prefill_tokens)
    server, port, health = grpc_util.create_server(f"{args.host}:{args.port}")
    address = advertised(args, port)
    metrics_port = metrics.start_metrics_server(args.metrics_port, args.host)
    member = make_member(
        nameservice_pb2.ROLE_MASTER, address, metrics_address=advertised(args, metrics_port)
    )
    bus = await Bus.connect(args.nats_url, member.id, args.nats_token)
    # Every replica charges every replica's routes (charge_exchange.py).
    exchange = ChargeExchange(view, bus, member.id, args.namespace) if bus.enabled else None
    servicer = MasterServicer(view, policy, exchange=exchange)
    master_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    names = NameClient(args.nameservice) if args.nameservice else None
    feeder: asyncio.Task[None] | None = None
    fetch = SnapshotClient()
    # The index starts empty: every worker of the first membership snapshot gets resynced.
    upkeep = asyncio.create_task(view.upkeep_forever(fetch), name="view-upkeep")
    try:
        await server.start()
        if bus.enabled:
            await view.subscribe(bus, args.namespace)
            await exchange.subscribe()
            await bus.flush()  # subscribed before anyone can find us
        else:
            log.warning("no --nats-url: routing by membership only (no prefix or load info)")
        if names is None:
            log.warning("no --nameservice: the master knows no workers and cannot route")
        else:
            feeder = asyncio.create_task(view.follow(names.watch()), name="cluster-view")
            await names.register(member)
        await grpc_util.set_serving(health, SERVICE_NAME, True)
        log.info(
            "master ready id=%s address=%s policy=%s index_loops=%s pid=%d",
            member.id,
            address,
            policy.name,
            "compiled" if block_ids.compiled() else "numpy",
            os.getpid(),
        )
        if not block_ids.compiled():
            log.warning("prefix index in numpy: _block_table not compiled at install, or disabled")
        # Both run until cancelled: either ending (an error) is fatal for the master.
        running = {upkeep} if feeder is None else {upkeep, feeder}
        done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        ended = done.pop()
        ended.result()
        raise RuntimeError(f"{ended.get_name()} ended")
    finally:
        await grpc_util.set_serving(health, SERVICE_NAME, False)
        for task in (feeder, upkeep):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await fetch.close()
        if names is not None:
            with contextlib.suppress(Exception):
                await names.close()
        await server.stop(grace=0.5)  # Route calls are short: stop promptly
        await bus.close()
