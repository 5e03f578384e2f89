"""`rtp-serve planner`: keeps the worker fleet at the size that meets the TTFT and ITL targets.

    rtp-serve planner --nameservice HOST:PORT --nats-url nats://HOST:PORT \\
        --mode fused --ttft-p95-ms 2000 --itl-p95-ms 200 --min-workers 0 --max-workers 8 \\
        --actuator local --worker-flags "--model DIR --threads 1"

Every --interval-s it runs one planning step (services/planner/planner.py). Its HTTP --port
serves /health, /ready, /metrics and /plan (the last step, JSON). Needs no torch. On SIGTERM
a local actuator's workers drain and stop with it; containers and Deployments stay.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import shlex
from pathlib import Path

from aiohttp import web

from rtp_serve.core.cost_model import StepCost
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.env import env
from rtp_serve.services.common.flags import add_common_flags, add_drain_flag
from rtp_serve.services.common.metrics import handle_metrics
from rtp_serve.services.common.naming import NameClient
from rtp_serve.services.common.pb import events_pb2
from rtp_serve.services.common.subjects import load_report_all
from rtp_serve.services.launcher.process import CLI, child_process
from rtp_serve.services.planner import metrics, predictor
from rtp_serve.services.planner.actuator import Actuator, MetricsActuator
from rtp_serve.services.planner.local_actuator import LocalActuator
from rtp_serve.services.planner.planner import Planner, Step
from rtp_serve.services.planner.scaler import Limits, Scaler
from rtp_serve.services.planner.signals import Observer
from rtp_serve.services.planner.sizing import Targets

log = logging.getLogger(__name__)

ACTUATORS = ("local", "docker", "metrics")
MODES = {"fused": ("fused",), "pd": ("prefill", "decode")}


def add_arguments(p: argparse.ArgumentParser, name: str = "planner") -> None:
    add_common_flags(p)  # --port: the HTTP port (/health, /ready, /metrics, /plan)
    add_drain_flag(p, "a stopped worker's requests")  # passed to local workers
    p.add_argument("--mode", choices=tuple(MODES), default=env("planner_mode", "fused"),
                   help="fused workers, or prefill + decode workers (each role sized)")  # fmt: skip
    p.add_argument("--actuator", choices=ACTUATORS, default=env("actuator", "local"),
                   help="local: start worker processes here; docker: the compose services' "
                   "containers; metrics: only publish rtp:planner_desired_workers (Kubernetes: "
                   "an HPA scales on it)")  # fmt: skip
    p.add_argument("--ttft-p95-ms", type=float, default=float(env("ttft_p95_ms", "2000")))
    p.add_argument("--itl-p95-ms", type=float, default=float(env("itl_p95_ms", "200")))
    p.add_argument("--headroom", type=float, default=float(env("planner_headroom", "0.8")),
                   help="size for this share of each target")  # fmt: skip
    p.add_argument("--min-workers", type=int, default=int(env("min_workers", "1")),
                   help="per role; 0: scale to zero when idle")  # fmt: skip
    p.add_argument("--max-workers", type=int, default=int(env("max_workers", "8")),
                   help="all roles together")  # fmt: skip
    p.add_argument("--interval-s", type=float, default=float(env("planner_interval_s", "5")))
    p.add_argument("--down-cooldown-s", type=float, default=float(env("down_cooldown_s", "30")))
    p.add_argument("--idle-to-zero-s", type=float, default=float(env("idle_to_zero_s", "60")),
                   help="with --min-workers 0: no request for this long stops every worker")  # fmt: skip
    p.add_argument("--max-step-up", type=int, default=4)
    p.add_argument("--predictor", choices=sorted(predictor.PREDICTORS), default="holt")
    p.add_argument("--cost", default=env("planner_cost"), metavar="FILE",
                   help="a worker's step cost until workers report their fitted one: a "
                   "bench/fit_sim.py profile (default: built-in)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=int(env("max_num_seqs", "64")),
                   help="the workers' batch bound")  # fmt: skip
    p.add_argument("--metrics-key", default=env("metrics_key"),
                   help="the key the frontends' /metrics need")  # fmt: skip
    local = p.add_argument_group("local actuator")
    local.add_argument("--engine", choices=("real", "sim"), default="real",
                       help="sim: start simulated workers (rtp-serve sim-worker)")  # fmt: skip
    local.add_argument("--worker-flags", default=env("worker_flags", ""),
                       help="the workers' flags, one shell-quoted string (--model, --threads, "
                       "...); --nameservice, --nats-url, --drain-timeout and --worker-id are "
                       "added")  # fmt: skip
    docker = p.add_argument_group("docker actuator")
    docker.add_argument("--docker-project", default=env("docker_project"),
                        help="the compose project whose worker services are scaled")  # fmt: skip


def fallback_step(path: str | None) -> StepCost:
    """A worker's step cost before any worker reports one: a fitted profile, or the
    simulator's built-in one (both in core/sim_cost.py's form)."""
    from rtp_serve.core.sim_cost import SimCost

    cost = SimCost.load(Path(path)) if path else SimCost()
    return StepCost(cost.fixed_s, cost.prefill_token_s, cost.decode_row_s, 512)


def make_actuator(args: argparse.Namespace, observer: Observer) -> Actuator:
    if args.actuator == "metrics":
        return MetricsActuator(lambda: {r: len(ids) for r, ids in observer.workers().items()})
    if args.actuator == "docker":
        from rtp_serve.services.planner.docker_actuator import DockerActuator

        def address(member_id: str) -> str | None:  # victims are member ids
            member = observer.members.members.get(member_id)
            return member.address if member is not None else None

        return DockerActuator(
            project=args.docker_project, locate=address, drain_timeout_s=args.drain_timeout
        )
    flags = shlex.split(args.worker_flags)
    common = ["--nameservice", args.nameservice, "--drain-timeout", str(args.drain_timeout)]
    if args.nats_url:
        common += ["--nats-url", args.nats_url]

    def argv(role: str, worker_id: str) -> list[str]:
        command = ["sim-worker", "--role", role, "--count", "1"] if args.engine == "sim" else [role]
        return [*CLI, *command, *common, "--worker-id", worker_id, *flags]

    return LocalActuator(argv, child_process, args.drain_timeout)


def plan_json(step: Step | None) -> dict:
    if step is None:
        return {}
    w = step.window
    finite = lambda x: None if x is None or math.isnan(x) or math.isinf(x) else x  # noqa: E731
    return {
        "current": step.current,
        "targets": step.decision.targets,
        "wanted": step.wanted,
        "reason": step.decision.reason,
        "rate": w.rate if w else 0.0,
        "forecast": step.forecast,
        "demand": {
            "rate": step.demand.rate,
            "prompt_tokens": step.demand.prompt_tokens,
            "output_tokens": step.demand.output_tokens,
        },  # fmt: skip
        "observed": {
            "ttft_p95_s": finite(w.ttft_p95_s) if w else None,
            "itl_p95_s": finite(w.itl_p95_s) if w else None,
            "waiting_for_workers": w.waiting_for_workers if w else 0,
        },  # fmt: skip
        "sized": {
            r: {
                "workers": s.workers,
                "feasible": s.feasible,
                "ttft_p95_s": finite(s.ttft_p95_s),
                "itl_s": finite(s.itl_s),
            }
            for r, s in step.sizings.items()
        },  # fmt: skip
        "corrections": {"prefill": step.corrections[0], "decode": step.corrections[1]},
    }


async def serve(args: argparse.Namespace) -> None:
    if args.nameservice is None:
        raise ValueError("the planner needs --nameservice (it watches the members)")
    if args.ttft_p95_ms <= 0 or args.itl_p95_ms <= 0 or args.interval_s <= 0:
        raise ValueError("--ttft-p95-ms, --itl-p95-ms and --interval-s must be positive")
    limits = Limits(
        min_workers=args.min_workers,
        max_workers=args.max_workers,
        max_step_up=args.max_step_up,
        down_cooldown_s=args.down_cooldown_s,
        idle_to_zero_s=args.idle_to_zero_s,
    )
    names = NameClient(args.nameservice)
    observer = Observer(names, args.metrics_key)
    actuator = make_actuator(args, observer)
    planner = Planner(
        observer,
        actuator,
        Scaler(limits, MODES[args.mode]),
        predictor.make(args.predictor),
        Targets(args.ttft_p95_ms / 1e3, args.itl_p95_ms / 1e3, args.headroom),
        fallback_step(args.cost),
        max_num_seqs=args.max_num_seqs,
    )
    families = metrics.planner()
    app = web.Application()
    app.router.add_get("/health", lambda _: web.json_response({"status": "ok"}))
    app.router.add_get("/ready", lambda _: web.json_response({"status": "ok"}))
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get(
        "/plan",
        lambda _: web.json_response(plan_json(planner.history[-1] if planner.history else None)),
    )
    runner = web.AppRunner(app, access_log=None)
    bus = await Bus.connect(args.nats_url, "planner", args.nats_token)
    await observer.start()
    await bus.subscribe(load_report_all(args.namespace), events_pb2.LoadReport, observer.on_load)
    try:
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        log.info(
            "planner on http://%s:%d: mode=%s actuator=%s targets ttft_p95=%.0fms itl_p95=%.0fms "
            "workers %d..%d interval %.1fs predictor %s",
            args.host, runner.addresses[0][1], args.mode, args.actuator, args.ttft_p95_ms,
            args.itl_p95_ms, args.min_workers, args.max_workers, args.interval_s, args.predictor,
        )  # fmt: skip
        while True:
            try:
                step = await planner.step()
                families.record(step)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("planning step failed; trying again next interval")
            await asyncio.sleep(args.interval_s)
    finally:
        with contextlib.suppress(Exception):
            await actuator.close()
        await observer.close()
        await bus.close()
        await names.close(deregister=False)
        await runner.cleanup()
