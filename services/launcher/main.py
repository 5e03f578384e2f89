"""`rtp-serve up`: the whole cluster on one machine, each service its own process.

Starts NATS and Redis from the pip-installed binaries (or uses --nats-url/--redis-url), then
nameservice, master, cache, the workers and the frontend; waits until the frontend is
ready and knows every worker, writes its URL to stdout, and on SIGTERM/SIGINT stops
everything it started. Children also get SIGKILL from the kernel if the launcher itself
dies (PR_SET_PDEATHSIG): no orphans.

Stopping drains: the frontend and the workers get SIGTERM first and together (they stop
taking requests and finish those in flight for up to --drain-timeout); then the master, the
cache and the nameservice, which stop promptly; whatever still runs at drain timeout +
STOP_SLACK_S is killed, so the whole cluster is gone within drain timeout + 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rtp_serve.services.common.env import env
from rtp_serve.services.common.flags import (
    DEFAULT_MODEL_HELP,
    add_drain_flag,
    add_lora_flags,
    add_model_flags,
)
from rtp_serve.services.launcher import certs, servers
from rtp_serve.services.launcher.process import CLI, child_process
from rtp_serve.services.launcher.secrets import ClusterSecrets
from rtp_serve.services.launcher.supervisor import RESTART_POLICIES, Supervisor

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 180.0
STOP_SLACK_S = 1.2  # past the drain timeout: for processes to exit before they are killed
# The rest stops once these are gone (the planner stops the workers it started, draining).
DRAINING = ("frontend", "prefill", "decode", "fused", "sim-worker", "planner")
# Stopped last, after every other service has deregistered from it.
LAST = ("nameservice",)
SUPERVISE_EVERY_S = 0.25  # how often exited children are noticed (and restarted)


def add_arguments(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument(
        "--model",
        default=env("model"),
        help=f"model directory or preset name, e.g. tiny-llama ({DEFAULT_MODEL_HELP})",
    )
    p.add_argument(
        "--port", type=int, default=int(env("port", "8000")), help="frontend HTTP port (0: any)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--fused", type=int, default=None, metavar="K", help="K fused workers (instead of PD)"
    )
    p.add_argument(
        "--engine",
        choices=("real", "sim"),
        default="real",
        help="sim: simulated workers (rtp-serve sim-worker: the real protocols, no model; "
        "step times from --sim-cost), docs/operations/scale.md",
    )
    p.add_argument(
        "--sim-cost",
        default=None,
        metavar="FILE",
        help="with --engine sim: the step-time profile (bench/fit_sim.py; default: built-in)",
    )
    p.add_argument(
        "--sim-step",
        choices=("sleep", "burn"),
        default=None,
        help="with --engine sim: how a step takes its time (default sleep); burn spends it on "
        "a core, so simulated workers share this machine's cores as real ones would",
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (PD mode)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (PD mode)")
    p.add_argument(
        "--nats-url", default=env("nats_url"), help="use this NATS instead of starting one"
    )
    p.add_argument(
        "--redis-url", default=env("redis_url"), help="use this Redis instead of starting one"
    )
    p.add_argument("--no-cache", action="store_true", help="run without the cache service tier")
    p.add_argument(
        "--cache-capacity-mib",
        type=int,
        default=None,
        help="the cache service's memory tier (T2) in MiB (default: the cache service's)",
    )
    p.add_argument(
        "--redis-maxmemory-mib",
        type=int,
        default=256,
        help="maxmemory of the Redis tier (T3) this starts, in MiB (LRU beyond it)",
    )
    p.add_argument("--policy", default="cache_aware")
    p.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=None,
        help="PD: prompts with fewer uncached tokens are prefilled on the decode worker "
        "(the master's default unless given; 0: always disaggregate)",
    )
    add_model_flags(p)  # passed to every worker (the frontend learns them from those)
    p.add_argument(
        "--kv-cache-mib",
        default="auto",
        help="KV cache per worker in MiB, or auto: half the available memory split among the "
        "workers started here, less their weights",
    )
    p.add_argument(
        "--host-kv-cache-mib",
        type=int,
        default=0,
        help="each worker's host-memory KV tier (T1) in MiB; 0: none",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per worker (0: PD workers each get every core, since they mostly "
        "take turns; fused replicas split the cores)",
    )
    p.add_argument("--speculative", default="none", choices=["none", "ngram", "draft"],
                   help="speculative decoding in every worker (see rtp-serve fused --help)")  # fmt: skip
    p.add_argument("--draft-model", default=None,
                   help="with --speculative draft: the draft model (a directory or preset)")  # fmt: skip
    p.add_argument("--draft-layers", type=int, default=None,
                   help="with --speculative draft: the draft's first N layers draft")  # fmt: skip
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="with --speculative: drafts per request and step at most")  # fmt: skip
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="per worker (default: the worker's)"
    )
    p.add_argument(
        "--max-num-waiting", type=int, default=None, help="per worker (default: the worker's)"
    )
    p.add_argument(
        "--itl-target-ms",
        type=float,
        default=None,
        help="per worker: cap a step's prompt tokens while requests decode (default: the "
        "worker's, off)",
    )
    add_lora_flags(p)  # passed to every worker and the frontend
    add_drain_flag(p, "the frontend and the workers finish what is in flight")
    p.add_argument("--ttl", type=float, default=3.0, help="nameservice heartbeat TTL (s)")
    p.add_argument(
        "--restart",
        choices=RESTART_POLICIES,
        default=env("restart", "no"),
        help="on-failure: start a process that exited again, same command line, with backoff "
        "(no: keep serving with what is left)",
    )
    p.add_argument("--info-file", default=None, help="write addresses and pids here (JSON) once up")
    add_planner_arguments(p)
    add_security_arguments(p)
    p.add_argument("--log-level", default=env("log_level", "INFO"))
    p.add_argument("--log-format", choices=("text", "json"), default=env("log_format", "text"))
    p.add_argument("--log-requests", action="store_true",
                   help="the frontend logs each request's route, predicted and actual time "
                   "to first token")  # fmt: skip


def add_planner_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("autoscaling (docs/operations/autoscaling.md): with --planner the "
                             "workers are the planner's, --fused/--prefill/--decode only choose "
                             "the mode")  # fmt: skip
    g.add_argument("--planner", action="store_true",
                   help="run the SLA planner, which starts and stops the workers (rtp-serve planner)")  # fmt: skip
    g.add_argument("--min-workers", type=int, default=1, help="per role; 0: scale to zero")
    g.add_argument("--max-workers", type=int, default=4, help="all roles together")
    g.add_argument("--ttft-p95-ms", type=float, default=2000.0)
    g.add_argument("--itl-p95-ms", type=float, default=200.0)
    g.add_argument("--planner-interval-s", type=float, default=1.0)
    g.add_argument("--down-cooldown-s", type=float, default=30.0)
    g.add_argument("--idle-to-zero-s", type=float, default=60.0)
    g.add_argument("--hold-for-workers-s", type=float, default=60.0,
                   help="with --min-workers 0: how long a request waits at the frontend for "
                   "a worker to start")  # fmt: skip


def add_security_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("security (docs/deployment/security.md); every secret reaches the services "
                             "that use it by environment, never by command line")  # fmt: skip
    s.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="frontend API key (repeatable); none: the API is open")  # fmt: skip
    s.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="frontend API keys, one per line")  # fmt: skip
    s.add_argument("--metrics-key", default=None, help="the key the frontend's /metrics needs")
    s.add_argument("--admin-key", default=None,
                   help="the key the frontend's LoRA admin endpoints need (with --lora-root)")  # fmt: skip
    s.add_argument("--lora-root", default=None, metavar="DIR",
                   help="the only directory the LoRA admin endpoints load adapters from")  # fmt: skip
    s.add_argument("--priority-floor", type=int, default=None, metavar="N",
                   help="the most urgent priority a request may ask for, unless its API key "
                   "carries its own (frontend default: 0)")  # fmt: skip
    s.add_argument("--nats-token", default=env("nats_token"),
                   help="NATS token: the NATS started here requires it, every service sends it")  # fmt: skip
    s.add_argument("--redis-password", default=env("redis_password"),
                   help="Redis password: the Redis started here requires it (requirepass)")  # fmt: skip
    s.add_argument("--kv-integrity-key", default=env("kv_integrity_key"),
                   help="workers' HMAC key for KV blocks in the cache tiers")  # fmt: skip
    s.add_argument("--tls", action="store_true",
                   help="mutual TLS on all internal gRPC, with a throwaway CA made at start")  # fmt: skip


@dataclass
class Cluster:
    args: argparse.Namespace
    data_dir: Path
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    infra: list[servers.ManagedProcess] = field(default_factory=list)
    addresses: dict[str, str] = field(default_factory=dict)
    secrets: ClusterSecrets = field(default_factory=ClusterSecrets)

    def info(self) -> dict:
        tls = self.secrets.tls
        return {
            **self.addresses,
            # The member certificate's files (paths, not secrets), for tools that call in.
            "tls": {"cert": str(tls.cert), "key": str(tls.key), "ca": str(tls.ca)} if tls else None,
            "pids": [{"name": n, "pid": p.pid} for n, p in self.procs]
            + [{"name": s.name, "pid": s.pid} for s in self.infra],
        }

    def spawn(self, name: str, *flags: str) -> subprocess.Popen:
        common = ["--log-level", self.args.log_level, "--log-format", self.args.log_format]
        proc = _child([*CLI, name, *common, *flags], self.secrets)
        self.procs.append((name, proc))
        log.info("started %s pid=%d", name, proc.pid)
        return proc

    def stop(self) -> None:
        """Drain the frontend and workers, then stop the rest, the name service last; kill
        what outlives the drain."""
        deadline = time.monotonic() + self.args.drain_timeout + STOP_SLACK_S
        first = [(n, p) for n, p in self.procs if n in DRAINING]
        rest = [(n, p) for n, p in reversed(self.procs) if n not in DRAINING + LAST]
        last = [(n, p) for n, p in self.procs if n in LAST]
        for group in (first, rest, last):
            for _, proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for name, proc in group:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning(
                        "%s (pid %d) still running %.1f s after SIGTERM; killing it",
                        name,
                        proc.pid,
                        self.args.drain_timeout + STOP_SLACK_S,
                    )
                    proc.kill()
                    proc.wait()
        for server in reversed(self.infra):
            server.stop(timeout=0.3)


def _child(argv: list[str], secrets: ClusterSecrets) -> subprocess.Popen:
    """A service process from its argv ([*CLI, SERVICE, ...]), with the secrets SERVICE uses
    in its environment (a restart gets them again)."""
    return child_process(argv, secrets.env(argv[len(CLI)]))


def _default_threads(args: argparse.Namespace) -> int:
    """Torch threads per worker on this one machine.

    Prefill and decode workers mostly take turns (short prompts stay on the decode worker,
    see the master's --max-local-prefill-tokens), so each gets every core: measured on a
    2-core box (llama-100m, 64 x 270 -> 128 tokens at concurrency 16), one core each gave
    18 tok/s and a 96 s median TTFT, all cores each 91 tok/s and 4.7 s, as fast as fused.
    Fused replicas do the same work side by side, so they split the cores.
    """
    cores = os.cpu_count() or 1
    return cores if not args.fused else max(1, cores // _worker_slots(args))


def _worker_count(args: argparse.Namespace) -> int:
    """Workers the cluster has once up (with the planner: its floor)."""
    if args.planner:
        return args.min_workers * (1 if args.fused else 2)
    return args.fused if args.fused else args.prefill + args.decode


def _worker_slots(args: argparse.Namespace) -> int:
    """Workers that may run at once here (what the cores and memory are shared by)."""
    return max(1, args.max_workers) if args.planner else _worker_count(args)


def _start_infra(cluster: Cluster) -> tuple[str, str | None]:
    """The cluster's certificates, NATS and Redis (those not given by URL), side by side:
    each server is waited on until it answers, so one after the other would add up."""
    args = cluster.args
    jobs: dict[str, Callable[[], object]] = {}
    if args.tls:
        jobs["tls"] = lambda: certs.issue_cluster_certs(cluster.data_dir / "tls")
    if args.nats_url is None:
        jobs["nats"] = lambda: servers.start_nats(cluster.data_dir / "nats", token=args.nats_token)
    if args.redis_url is None and not args.no_cache:
        jobs["redis"] = lambda: servers.start_redis(
            cluster.data_dir / "redis",
            maxmemory=f"{args.redis_maxmemory_mib}mb",
            password=args.redis_password,
        )
    with ThreadPoolExecutor(max(1, len(jobs)), thread_name_prefix="infra") as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
    done = {name: f.result() for name, f in futures.items() if f.exception() is None}
    cluster.infra += [done[n] for n in ("nats", "redis") if n in done]  # stopped on failure too
    for future in futures.values():
        if future.exception() is not None:
            raise future.exception()
    cluster.secrets = ClusterSecrets.from_args(args, done.get("tls"))
    nats_url = done["nats"].url if "nats" in done else args.nats_url
    redis_url = done["redis"].url if "redis" in done else args.redis_url
    return nats_url, redis_url


def _start(cluster: Cluster, model: str) -> str:
    """Infrastructure first, then every service at once (none waits for another: each
    connects and registers as it comes up)."""
    args = cluster.args
    nats_url, redis_url = _start_infra(cluster)
    ns_port, ns_metrics_port = servers.free_port(), servers.free_port()
    nameservice = f"127.0.0.1:{ns_port}"
    cluster.addresses.update(nats=nats_url, redis=redis_url or "", nameservice=nameservice)
    # The nameservice is no member of itself, so its metrics address is only known here.
    cluster.addresses["nameservice_metrics"] = f"127.0.0.1:{ns_metrics_port}"
    cluster.spawn("nameservice", "--port", str(ns_port), "--ttl", str(args.ttl),
                  "--nats-url", nats_url, "--metrics-port", str(ns_metrics_port))  # fmt: skip
    common = ["--nameservice", nameservice, "--nats-url", nats_url]
    master = [*common, "--policy", args.policy]
    if args.max_local_prefill_tokens is not None:
        master += ["--max-local-prefill-tokens", str(args.max_local_prefill_tokens)]
    cluster.spawn("master", *master)
    if not args.no_cache:
        capacity = ()
        if args.cache_capacity_mib is not None:
            capacity = ("--capacity-mib", str(args.cache_capacity_mib))
        cluster.spawn("cache", *common, "--redis-url", redis_url, *capacity)
    drain = ["--drain-timeout", str(args.drain_timeout)]
    worker = [*common, *drain, *(_sim_flags(args, model) if args.engine == "sim" else
                                 _worker_flags(args, model))]  # fmt: skip
    if args.planner:
        _spawn_planner(cluster, common, worker[len(common) + len(drain) :], drain)
    else:
        roles = (
            ["fused"] * args.fused
            if args.fused
            else ["prefill"] * args.prefill + ["decode"] * args.decode
        )
        for role in roles:
            if args.engine == "sim":
                cluster.spawn("sim-worker", "--role", role, "--count", "1", *worker)
            else:
                cluster.spawn(role, *worker)
    port = args.port or servers.free_port()
    keys = ["--api-key-file", args.api_key_file] if args.api_key_file else []
    keys += ["--lora-root", args.lora_root] if args.lora_root else []
    keys += (
        ["--priority-floor", str(args.priority_floor)] if args.priority_floor is not None else []
    )
    keys += ["--log-requests"] if args.log_requests else []
    loras = [f"--lora={name}={path}" for name, path in args.loras]
    if args.planner and args.min_workers == 0:
        keys += ["--hold-for-workers-s", str(args.hold_for_workers_s)]
    # The frontend is on no NATS: membership comes from the nameservice, routes from the master.
    cluster.spawn("frontend", "--nameservice", nameservice, *drain, "--model", model, *keys, *loras,
                  "--host", args.host, "--port", str(port))  # fmt: skip
    cluster.addresses["frontend"] = f"http://{args.host}:{port}"
    return cluster.addresses["frontend"]


def _numerics(args: argparse.Namespace) -> list[str]:
    return ["--dtype", args.dtype, "--weight-dtype", args.weight_dtype,
            "--kv-dtype", args.kv_dtype, "--block-size", str(args.block_size)]  # fmt: skip


def _limits(args: argparse.Namespace, *flags: str) -> list[str]:
    """The given per-worker flags that were set, as worker flags."""
    out: list[str] = []
    for flag in flags:
        if getattr(args, flag) is not None:
            out += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return out


def _worker_flags(args: argparse.Namespace, model: str) -> list[str]:
    """A real worker's flags (after --nameservice, --nats-url and --drain-timeout)."""
    if args.sim_cost or args.sim_step:
        raise SystemExit(
            "--sim-cost and --sim-step are a simulated worker's: they need --engine sim"
        )
    threads = args.threads or _default_threads(args)
    flags = ["--model", model, *_numerics(args), "--threads", str(threads),
             "--kv-cache-mib", str(args.kv_cache_mib),
             "--host-kv-cache-mib", str(args.host_kv_cache_mib),
             "--memory-share", str(_worker_slots(args)),
             "--speculative", args.speculative]  # fmt: skip
    if args.draft_model is not None:
        from rtp_serve.models.make_model import resolve_model

        flags += ["--draft-model", str(resolve_model(args.draft_model))]
    flags += _limits(args, "max_num_seqs", "max_num_waiting", "itl_target_ms",
                     "num_speculative_tokens", "draft_layers")  # fmt: skip
    loras = [f"--lora={name}={path}" for name, path in args.loras]
    return [*flags, *loras, "--max-loras", str(args.max_loras)]


# What a simulated worker has no part of: refused by name rather than ignored.
_NOT_SIMULATED = {
    "--threads": lambda a: a.threads != 0,
    "--host-kv-cache-mib": lambda a: a.host_kv_cache_mib != 0,
    "--speculative": lambda a: a.speculative != "none",
    "--draft-model": lambda a: a.draft_model is not None,
    "--lora": lambda a: bool(a.loras),
    "--itl-target-ms": lambda a: a.itl_target_ms is not None,
}


def _sim_flags(args: argparse.Namespace, model: str) -> list[str]:
    """A simulated worker's flags: the same model, numerics, pool size and limits as a real
    one's, and the step-time profile."""
    refused = [flag for flag, given in _NOT_SIMULATED.items() if given(args)]
    if refused:
        raise SystemExit(f"--engine sim: simulated workers have no {', '.join(refused)}")
    flags = ["--model", model, *_numerics(args)]
    if args.kv_cache_mib != "auto":
        flags += ["--kv-cache-mib", str(args.kv_cache_mib)]
    if args.sim_cost:
        flags += ["--cost", str(Path(args.sim_cost).resolve())]
    if args.sim_step:
        flags += ["--step", args.sim_step]
    return [*flags, *_limits(args, "max_num_seqs", "max_num_waiting")]


def _spawn_planner(
    cluster: Cluster, common: list[str], worker_flags: list[str], drain: list[str]
) -> None:
    """The planner, which starts the workers (their flags as one string) and stops them."""
    args = cluster.args
    port = servers.free_port()
    cluster.addresses["planner"] = f"http://127.0.0.1:{port}"
    cluster.spawn(
        "planner", *common, *drain, "--port", str(port), "--actuator", "local",
        "--engine", args.engine,
        "--mode", "fused" if args.fused else "pd",
        "--worker-flags", shlex.join(worker_flags),
        "--min-workers", str(args.min_workers), "--max-workers", str(args.max_workers),
        "--ttft-p95-ms", str(args.ttft_p95_ms), "--itl-p95-ms", str(args.itl_p95_ms),
        "--interval-s", str(args.planner_interval_s),
        "--down-cooldown-s", str(args.down_cooldown_s),
        "--idle-to-zero-s", str(args.idle_to_zero_s),
        *(["--cost", str(Path(args.sim_cost).resolve())] if args.sim_cost else []),
    )  # fmt: skip


def _write_info(cluster: Cluster) -> None:
    if cluster.args.info_file:  # written whole, then renamed: readers never see half of it
        path = Path(cluster.args.info_file)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cluster.info(), indent=2))
        tmp.replace(path)


def _ready(url: str, workers: int) -> bool:
    """The frontend can route, and knows all `workers` started here (the first to register
    makes it ready; "up" before the others would start a benchmark on part of the cluster)."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=1.0) as reply:
            body = json.loads(reply.read() or b"{}")
            return reply.status == 200 and body.get("workers", workers) >= workers
    except (OSError, ValueError):
        return False


async def serve(args: argparse.Namespace) -> None:
    from rtp_serve.models.make_model import resolve_model  # a directory, a preset or the default

    model = str(await asyncio.to_thread(resolve_model, args.model))
    with tempfile.TemporaryDirectory(prefix="rtp-serve-") as tmp:
        cluster = Cluster(args, Path(tmp))
        try:
            url = await asyncio.to_thread(_start, cluster, model)
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not await asyncio.to_thread(_ready, url, _worker_count(args)):
                dead = [(n, p.returncode) for n, p in cluster.procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"cluster process exited during start-up: {dead}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"frontend {url} not ready after {READY_TIMEOUT_S:.0f} s")
                await asyncio.sleep(0.2)
            _write_info(cluster)
            sys.stdout.write(f"rtp-serve is up: {url}/v1 (model {model})\n")
            sys.stdout.flush()
            supervisor = Supervisor(args.restart, lambda argv: _child(argv, cluster.secrets))
            while True:
                await asyncio.sleep(SUPERVISE_EVERY_S)
                if await asyncio.to_thread(supervisor.check, cluster.procs, cluster.infra):
                    _write_info(cluster)  # the new pids
        finally:
            await asyncio.to_thread(cluster.stop)
