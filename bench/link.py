"""The KV hand-off between a prefill and a decode container against prompt length and the
rate of the link between them, and the conditional-disaggregation threshold that follows.

    sudo .venv/bin/python bench/link.py [--lengths 128,512,1024,1792] [--reps 2]
        [--links none,1gbit,100mbit] [--rtt-ms 1,10] [--project rtplink] [--port N]

Runs compose.yaml as its own project (images built already: docker/build-images.sh), one
prefill and one decode container, `RTP_WORKER_THREADS` torch threads each (default 1), and
takes it down (`down -v`) however it ends. Root: the links are shaped from the host.

The link. Each container has its own address on the compose network. From the host,
`nsenter -t <container pid> -n tc ...` puts an HTB class of the given rate on each side's
eth0 with a u32 filter on the other's address: prefill -> decode (the KV) and back (the
request, TCP's acks) run at the rate, everything else (NATS, the cache service) unshaped.
No image change and no capability for the serving containers. Delay is not shaped: this
kernel has no netem (CONFIG_NET_SCH_NETEM unset); --rtt-ms adds round trips to the fitted
latency instead, on paper.

The hand-off. The bench calls the decode worker's Generate itself (no frontend, no master:
nothing routes), greedy, 3 output tokens, a fresh random prompt each time (no prefix hit).
PD: with prefill_address, the decode worker forwards the prefill worker's first token at
once, before any KV moves, so time to first token does not see the link; the second token
comes after the KV blocks arrived, were joined and imported, and one decode step ran.
Local: without it, the decode worker computes the prompt itself (what conditional
disaggregation does below the threshold); its second token comes one decode step after
the first. So

    hand-off(n)  =  gap(first -> second token, PD)  -  median gap (local), same n

the window the decode worker times for its own "transfer" fit (first token in -> last block
in, services/decode/servicer.py), plus the import. KV bytes: the decode worker's
rtp:kv_transfer_bytes_total{direction="received"} before and after each request. Prefill
rate P: the prompt tokens over the local runs' prefill_s (GenerateResponse) on the decode
worker, beside its own fitted rate (Stats, as its load reports carry it). Per link, a least
squares fit hand-off = L + bytes * byte_s (core/cost_model.py's LinearFit, as the worker
fits its transfers), and the threshold from it (core/cost_model.local_prefill_threshold).

The machine is shared: every number is noisy; the reps are few to keep the run short.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from rtp_serve.core.cost_model import FetchCost, LinearFit, local_prefill_threshold  # noqa: E402
from rtp_serve.core.sampling_params import SamplingParams  # noqa: E402
from rtp_serve.services.common.convert import params_to_pb  # noqa: E402
from rtp_serve.services.common.grpc_util import check_health  # noqa: E402
from rtp_serve.services.common.pb import worker_pb2, worker_pb2_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GRPC_PORT, METRICS_PORT = 50051, 9100  # every container's (compose.yaml)
MAX_CONTEXT = 2048  # smollm2-135m's
VOCAB = (200, 49000)  # random prompt ids from here: past the special tokens
# Three tokens, two timed: a local request's last output also carries its prompt's KV for
# the cache tier (read out of the pool as it finishes), which its second must not wait for.
GREEDY = params_to_pb(
    SamplingParams(max_tokens=3, min_tokens=3, ignore_eos=True, num_speculative_tokens=0)
)


@dataclass(frozen=True, slots=True)
class Container:
    id: str
    pid: int
    ip: str


@dataclass(frozen=True, slots=True)
class Sample:
    tokens: int
    gap_s: float  # first token -> second token, at the client
    prefill_s: float  # as the worker that computed the prompt reported it
    kv_bytes: int  # received by the decode worker (0: local)


def cpu_flags() -> str:
    from rtp_serve.kernels.isa import bench_flags

    return bench_flags()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Compose:
    """`docker-compose -p PROJECT -f compose.yaml ...` (1.29 and v2 alike, as `docker-compose`)."""

    def __init__(self, project: str, port: int, threads: str) -> None:
        self.project, self.port = project, port
        self.env = {**os.environ, "RTP_HTTP_PORT": str(port), "RTP_WORKER_THREADS": threads}

    def run(self, *args: str, capture: bool = False) -> str:
        cmd = ["docker-compose", "-p", self.project, "-f", "compose.yaml", *args]
        out = subprocess.run(
            cmd, cwd=ROOT, env=self.env, check=True, text=True, capture_output=capture
        )
        return out.stdout if capture else ""

    def wait_ready(self, timeout: float) -> None:
        """docker-compose 1.29 has no `up --wait`: the frontend's /ready, as its healthcheck."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            url = f"http://127.0.0.1:{self.port}/ready"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2):
                return
            time.sleep(2)
        raise SystemExit(f"the frontend was not ready within {timeout:.0f} s")

    def container(self, service: str) -> Container:
        cid = self.run("ps", "-q", service, capture=True).split()[0]
        fmt = "{{.State.Pid}} {{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}"
        pid, ip = subprocess.run(
            ["docker", "inspect", "-f", fmt, cid], check=True, text=True, capture_output=True
        ).stdout.split()[:2]
        return Container(cid, int(pid), ip)


# -- the link -------------------------------------------------------------------------------
def tc(c: Container, command: str, check: bool = True) -> str:
    """`tc COMMAND` in the container's network namespace, run from the host."""
    cmd = ["nsenter", "-t", str(c.pid), "-n", "tc", *command.split()]
    return subprocess.run(cmd, check=check, text=True, capture_output=True).stdout


def unshape(c: Container) -> None:
    tc(c, "qdisc del dev eth0 root", check=False)


def shape(c: Container, peer: Container, rate: str) -> None:
    """Traffic from `c` to `peer` at `rate` (tc's units: 1gbit, 100mbit); the rest as before
    (HTB sends what no filter classifies unshaped)."""
    unshape(c)
    unit = {"k": 1e3, "m": 1e6, "g": 1e9}[rate.lower().removesuffix("bit")[-1]]
    # 8 ms of tokens: smaller buckets fell short of the rate on this loaded 2-core box
    burst = max(128 * 1024, int(float(rate[:-4]) * unit / 8 * 0.008))
    tc(c, "qdisc add dev eth0 root handle 1: htb")
    tc(
        c,
        f"class add dev eth0 parent 1: classid 1:10 htb rate {rate} ceil {rate} "
        f"burst {burst} cburst {burst} quantum 60000",
    )
    tc(
        c,
        f"filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst {peer.ip}/32 flowid 1:10",
    )


def shaped_bytes(c: Container) -> int:
    """Bytes that went through the shaped class (proof the filter matched)."""
    out = tc(c, "-s class show dev eth0 classid 1:10", check=False).split()
    return int(out[out.index("Sent") + 1]) if "Sent" in out else 0


@contextlib.contextmanager
def link(prefill: Container, decode: Container, rate: str) -> Iterator[None]:
    if rate != "none":
        shape(prefill, decode, rate)
        shape(decode, prefill, rate)
    try:
        yield
    finally:
        unshape(prefill)
        unshape(decode)


# -- requests -------------------------------------------------------------------------------
def kv_received(decode: Container) -> int:
    url = f"http://{decode.ip}:{METRICS_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "rtp:kv_transfer_bytes":
            return int(
                sum(
                    s.value
                    for s in family.samples
                    if s.name.endswith("_total") and s.labels.get("direction") == "received"
                )
            )
    return 0


async def one(stub, decode: Container, tokens: int, prefill_address: str) -> Sample:
    rng = random.Random(uuid.uuid4().int)
    request = worker_pb2.GenerateRequest(
        request_id=f"link-{uuid.uuid4().hex[:12]}",
        prompt_token_ids=[rng.randrange(*VOCAB) for _ in range(tokens)],
        params=GREEDY,
        prefill_address=prefill_address,
    )
    before = kv_received(decode)
    stamps, prefill_s = [], 0.0
    async for msg in stub.Generate(request, timeout=300):
        if msg.token_ids:
            stamps.append(time.perf_counter())
            prefill_s = prefill_s or msg.prefill_s
    if len(stamps) < 3:
        raise SystemExit(f"expected 3 token messages, got {len(stamps)}")
    return Sample(tokens, stamps[1] - stamps[0], prefill_s, kv_received(decode) - before)


async def measure(args, prefill: Container, decode: Container) -> None:
    address = f"{prefill.ip}:{GRPC_PORT}"
    async with grpc.aio.insecure_channel(f"{decode.ip}:{GRPC_PORT}") as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        for target in (address, ""):  # warm both paths (first-use allocations, channels)
            await one(stub, decode, 64, target)
        # Each rep runs every mode in turn, so the machine's load drifts over all of them.
        local: list[Sample] = []
        pd: dict[str, list[Sample]] = {name: [] for name in args.links}
        sent = dict.fromkeys(args.links, 0)
        for _ in range(args.reps):
            local += [await one(stub, decode, n, "") for n in args.lengths]
            for name in args.links:
                with link(prefill, decode, name):
                    pd[name] += [await one(stub, decode, n, address) for n in args.lengths]
                    sent[name] += shaped_bytes(prefill) if name != "none" else 0
        stats = await stub.Stats(worker_pb2.WorkerStatsRequest(), timeout=10)
    step = {n: statistics.median(s.gap_s for s in local if s.tokens == n) for n in args.lengths}
    rate = sum(s.tokens for s in local) / sum(s.prefill_s for s in local)
    print(
        f"CPU flags: {cpu_flags()}   decode worker: {stats.cpu_isa}, {stats.dtype}, "
        f"KV {stats.kv_dtype}; {args.threads} torch thread(s) a worker; shared machine, "
        f"medians of {args.reps}"
    )
    print(
        f"prefill rate P on the decode worker (local runs): {rate:,.0f} tok/s "
        f"(its fitted rate, Stats/LoadReport: {stats.prefill_tokens_per_s:,.0f} tok/s)"
    )
    print(
        "decode step after a local prefill: "
        + ", ".join(f"{n}: {step[n] * 1e3:.0f} ms" for n in args.lengths)
    )
    print()
    print(
        f"{'link':>8} {'prompt':>7} {'KV bytes':>11} {'hand-off ms':>12} {'MB/s':>8}"
        f" {'PD gap ms':>10} {'prefill tok/s':>14}"
    )
    fits: dict[str, tuple[FetchCost, float, int]] = {}
    for name, samples in pd.items():
        fit = LinearFit(2, half_life=1e12)  # plain least squares, coefficients >= 0
        for n in args.lengths:
            rows = [s for s in samples if s.tokens == n]
            handoff = [s.gap_s - step[n] for s in rows]
            kv = statistics.median(s.kv_bytes for s in rows)
            for s, h in zip(rows, handoff, strict=True):
                fit.observe((1.0, float(s.kv_bytes)), h)
            h = statistics.median(handoff)
            mbs = kv / h / 1e6 if h > 0 else float("inf")
            tps = n / statistics.median(s.prefill_s for s in rows)
            print(
                f"{name:>8} {n:>7} {kv:>11,.0f} {h * 1e3:>12.1f} {mbs:>8.1f}"
                f" {statistics.median(s.gap_s for s in rows) * 1e3:>10.1f} {tps:>14,.0f}"
            )
        per_token = sum(s.kv_bytes for s in samples) / sum(s.tokens for s in samples)
        fits[name] = (FetchCost(*fit.coefficients()), per_token, sent[name])
    print()
    print_thresholds(fits, rate, args.rtt_ms)


def print_thresholds(fits: dict[str, tuple[FetchCost, float, int]], rate: float, rtts) -> None:
    def shown(t: int | None) -> str:
        return (
            f">= {MAX_CONTEXT} (every prompt local)" if t is None or t > MAX_CONTEXT else f"{t:,}"
        )

    print(
        f"--max-local-prefill-tokens = ceil(L / (1/P - b * byte_s)), P = {rate:,.0f} tok/s, "
        "one decode stream stalled (today's default: 1,024)"
    )
    b = statistics.median(per_token for _, per_token, _ in fits.values())
    print(f"a link slower than b * P = {b * rate / 1e6:,.2f} MB/s keeps every prompt local")
    print(
        f"{'link':>8} {'L ms':>7} {'fit MB/s':>9} {'b B/tok':>8} {'shaped MB':>10}"
        f" {'threshold':>28}" + "".join(f" {f'+{r:g} ms RTT':>28}" for r in rtts)
    )
    for name, (cost, per_token, sent) in fits.items():
        mbs = 1 / cost.byte_s / 1e6 if cost.byte_s > 0 else float("inf")
        cells = [
            shown(
                local_prefill_threshold(
                    rate, FetchCost(cost.fixed_s + r / 1e3, cost.byte_s), per_token
                )
            )
            for r in (0.0, *rtts)
        ]
        print(
            f"{name:>8} {cost.fixed_s * 1e3:>7.1f} {mbs:>9.1f} {per_token:>8,.0f}"
            f" {sent / 1e6:>10.1f}" + "".join(f" {c:>28}" for c in cells)
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="128,512,1024,1792", help="prompt tokens, comma-separated")
    p.add_argument("--links", default="none,1gbit,100mbit", help="tc rates; none: unshaped")
    p.add_argument("--reps", type=int, default=2, help="requests per prompt length and link")
    p.add_argument("--rtt-ms", default="1,10", help="round trips added to L, on paper")
    p.add_argument("--project", default="rtplink", help="the compose project name")
    p.add_argument("--port", type=int, default=0, help="the frontend's host port (0: a free one)")
    p.add_argument("--threads", default=os.environ.get("RTP_WORKER_THREADS", "1"))
    p.add_argument("--ready-timeout", type=float, default=900.0)
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.links = args.links.split(",")
    args.rtt_ms = [float(x) for x in args.rtt_ms.split(",") if x]
    if max(args.lengths) + 3 > MAX_CONTEXT:
        raise SystemExit(f"prompts must leave room for 3 tokens in {MAX_CONTEXT}")
    compose = Compose(args.project, args.port or free_port(), args.threads)
    try:
        compose.run("up", "-d", "--no-build")
        compose.wait_ready(args.ready_timeout)
        prefill, decode = compose.container("prefill"), compose.container("decode")
        for c in (prefill, decode):
            if not asyncio.run(check_health(f"{c.ip}:{GRPC_PORT}", timeout=5)):
                raise SystemExit(f"worker {c.ip} is not serving")
        asyncio.run(measure(args, prefill, decode))
    finally:
        compose.run("down", "-v")


if __name__ == "__main__":
    main()
