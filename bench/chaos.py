"""Chaos under load: a launched cluster serving steady streaming traffic, one fault at a time.

    python bench/chaos.py --model tiny-llama --topology pd:2:2     # every fault, PD
    python bench/chaos.py --topology fused:2 --faults fused,stop-fused
    python bench/chaos.py --test-size                             # what tests/test_chaos.py runs

The cluster runs with `--restart on-failure`, so a killed process is started again by the
launcher, as an orchestrator would. Per fault, while `--clients` greedy streams run back to
back: SIGKILL one process (a worker while it runs a request: mid-prefill on a prefill worker,
mid-transfer or mid-decode on a decode worker), or SIGSTOP a process for STOP_TTLS heartbeat
TTLs and then SIGCONT it (a hung worker, which the cluster declares dead; a hung nameservice,
which must not declare everyone dead when it runs again). Reported per fault:

- requests finished during the phase, failed ones and texts that differ from the offline
  engine's (the goal is 0 and 0 for every fault but the frontend's own);
- recovery: seconds from the fault until routing is healthy again (the process is back, every
  role has as many members as before, and a probe request is served on the master's route);
- blocks still held by the workers once traffic stopped (0: nothing leaked);
- whether the master's prefix index equals what the workers and the cache instances' memory
  hold (the index resynced);
- members the nameservice dropped for missed heartbeats meanwhile (a stopped nameservice
  must drop none once it runs again).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent  # run as a script: the repository root first
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import aiohttp  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from rtp_serve.kernels.isa import cpu_isa  # noqa: E402
from rtp_serve.services.common import grpc_util  # noqa: E402
from rtp_serve.services.common.pb import (  # noqa: E402
    cache_pb2_grpc,
    master_pb2,
    master_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from rtp_serve.services.common.pb import nameservice_pb2 as ns  # noqa: E402
from rtp_serve.services.common.pb import nameservice_pb2_grpc as ns_grpc  # noqa: E402
from rtp_serve.services.launcher.process import alive, launch  # noqa: E402

STOP_TTLS = 3.0  # a stopped worker stays stopped this many TTLs: it is declared dead first
RECOVERY_TIMEOUT_S = 60.0
WORKER_ROLES = (ns.ROLE_PREFILL, ns.ROLE_DECODE, ns.ROLE_FUSED)
MEMBERS = ("prefill", "decode", "fused", "master", "cache", "frontend")  # they register
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived",
    "1 2 3 4 5 6 7 8",
    "Rain falls on the " * 6,
    "def fibonacci(n):",
    "Paris is the capital of",
    "alpha beta gamma delta " * 10,
    "Hello",
]
# Every len(PROMPTS) + 1-th request is a long prompt (about 1,500 tokens, ~90 KV blocks), so
# that its KV transfer from a prefill to a decode worker lasts long enough to be caught
# under way; each a variant no worker has seen yet (its first block differs, so no block is
# a prefix-cache hit and the whole prompt moves), until all have been sent.
LONG_PROMPTS = [
    f"Record {i}. " + "The history of the old harbour town, told street by street: " * 60
    for i in range(48)
]


@dataclass(frozen=True, slots=True)
class Fault:
    name: str  # the table row
    process: str  # the launcher's name for the process it hits
    stop: bool = False  # SIGSTOP for STOP_TTLS TTLs, then SIGCONT (else SIGKILL)
    # Wait until the victim (a worker) is in this phase: "busy" with a request (running or
    # queued in its engine: a prefill worker's whole prompt runs in one step, so it is seen
    # queued, never running, between steps), or a prompt's KV "transfer" under way (sending
    # it, a prefill worker; receiving it, a decode worker).
    phase: str = ""

    @property
    def may_fail(self) -> bool:
        """Requests in flight through a killed frontend are lost with it; nothing else is."""
        return self.process == "frontend"


FAULTS = {
    f.name: f
    for f in (
        Fault("prefill", "prefill", phase="busy"),
        Fault("decode", "decode", phase="busy"),
        Fault("prefill-transfer", "prefill", phase="transfer"),
        Fault("decode-transfer", "decode", phase="transfer"),
        Fault("fused", "fused", phase="busy"),
        Fault("stop-decode", "decode", stop=True),
        Fault("stop-fused", "fused", stop=True),
        Fault("cache", "cache"),
        Fault("redis", "redis"),
        Fault("nats", "nats"),
        Fault("master", "master"),
        Fault("nameservice", "nameservice"),
        Fault("stop-nameservice", "nameservice", stop=True),
        Fault("frontend", "frontend"),
    )
}
ALL_PD = ["prefill", "decode", "prefill-transfer", "decode-transfer", "stop-decode", "cache",
          "redis", "nats", "master", "nameservice", "stop-nameservice", "frontend"]  # fmt: skip
ALL_FUSED = ["fused", "stop-fused", "cache", "redis", "nats", "master", "nameservice",
             "frontend"]  # fmt: skip


@dataclass(slots=True)
class Row:
    fault: str
    requests: int = 0  # finished (either way) during the phase
    failed: int = 0
    mismatched: int = 0  # served, but not the offline engine's text
    recovery_s: float | None = None  # None: not healthy within RECOVERY_TIMEOUT_S
    leaked_blocks: int = 0
    index_ok: bool = False
    expired: int | None = None  # members the nameservice dropped for silence (None: restarted)
    caught: bool | None = None  # the victim was seen in the fault's phase before the kill
    errors: list[str] = field(default_factory=list)  # the first few, for the reader

    def passed(self, fault: Fault) -> bool:
        lost_ok = fault.may_fail or self.failed == 0
        healthy = self.recovery_s is not None and self.index_ok
        # A hung nameservice, once it runs again, must not drop the members it did not hear.
        spurious = fault.name == "stop-nameservice" and self.expired != 0
        return (
            self.caught is not False  # the phase it is about was hit
            and lost_ok
            and self.mismatched == 0
            and healthy
            and self.leaked_blocks == 0
            and not spurious
        )


# -- the traffic -----------------------------------------------------------------------------
class Traffic:
    """`clients` loops, each streaming one greedy completion after another."""

    def __init__(self, url: str, model_id: str, reference: dict[str, str], max_tokens: int):
        self.url, self.model_id, self.reference = url, model_id, reference
        self.max_tokens = max_tokens
        self.row: Row | None = None  # the phase outcomes are counted into
        self._long = itertools.cycle(LONG_PROMPTS)

    async def run(self, clients: int, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=120, sock_connect=2)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.gather(*(self._client(http, i, stop) for i in range(clients)))

    async def _client(self, http: aiohttp.ClientSession, i: int, stop: asyncio.Event) -> None:
        turn = i
        while not stop.is_set():
            n = turn % (len(PROMPTS) + 1)
            prompt = PROMPTS[n] if n < len(PROMPTS) else next(self._long)
            turn += 1
            row = self.row
            try:
                text = await self._stream(http, prompt)
            except Exception as exc:  # any failure a client would see
                if row is not None:
                    row.requests += 1
                    row.failed += 1
                    if len(row.errors) < 3:
                        row.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.05)
                continue
            if row is not None:
                row.requests += 1
                if text != self.reference[prompt]:
                    row.mismatched += 1
                    if len(row.errors) < 3:
                        row.errors.append(f"text differs for {prompt!r}: {text!r}"[:200])

    async def _stream(self, http: aiohttp.ClientSession, prompt: str) -> str:
        body = {"model": self.model_id, "prompt": prompt, "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        parts = []
        async with http.post(self.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:120]}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"error chunk: {chunk['error']}")
                parts.append(chunk["choices"][0]["text"])
        return "".join(parts)


# -- the cluster as the harness sees it --------------------------------------------------------
class View:
    def __init__(self, url: str, info_file: Path, ttl: float) -> None:
        self.url, self.info_file, self.ttl = url, info_file, ttl
        self.roles: Counter = Counter()  # members by role of the whole cluster, once up

    def info(self) -> dict:
        return json.loads(self.info_file.read_text())

    def pids(self, name: str) -> list[int]:
        return [p["pid"] for p in self.info()["pids"] if p["name"] == name]

    async def heartbeats_missed(self, http: aiohttp.ClientSession) -> float | None:
        """The nameservice's count of members dropped for silence (None: unreachable)."""
        try:
            async with http.get(f"http://{self.info()['nameservice_metrics']}/metrics") as r:
                text = await r.text()
        except Exception:
            return None
        return metric_sum(text, "rtp:heartbeats_missed_total")

    async def members(self) -> list[ns.Member] | None:
        """Everyone registered, or None while the nameservice does not answer."""
        try:
            async with grpc_util.channel(self.info()["nameservice"]) as ch:
                reply = await ns_grpc.NameServiceStub(ch).List(ns.ListRequest(), timeout=1)
        except Exception:
            return None
        return list(reply.members)

    async def worker_stats(self, member: ns.Member) -> worker_pb2.WorkerStats | None:
        try:
            async with grpc_util.channel(member.address) as ch:
                return await worker_pb2_grpc.WorkerStub(ch).Stats(
                    worker_pb2.WorkerStatsRequest(), timeout=2
                )
        except Exception:
            return None

    async def master_routes(self, http: aiohttp.ClientSession) -> float:
        """The frontend's count of routes the master chose (rtp:routes_total)."""
        async with http.get(self.url + "/metrics") as r:
            text = await r.text()
        return metric_sum(text, "rtp:routes_total", source="master")

    async def probe(self, http: aiohttp.ClientSession, model_id: str) -> bool:
        """One request served, on a route the master chose."""
        try:
            before = await self.master_routes(http)
            body = {"model": model_id, "prompt": "probe", "max_tokens": 2}
            async with http.post(self.url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    return False
            return await self.master_routes(http) > before
        except Exception:
            return False

    async def index_matches(self, timeout: float = 15.0) -> bool:
        """The master's index equals the union of the workers' snapshots, within `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if await self._index_once():
                    return True
            await asyncio.sleep(0.2)
        return False

    async def _index_once(self) -> bool:
        members = await self.members() or []
        masters = [m for m in members if m.role == ns.ROLE_MASTER]
        if len(masters) != 1:
            return False
        async with grpc_util.channel(masters[0].address) as ch:
            reply = await master_pb2_grpc.MasterStub(ch).Index(master_pb2.IndexRequest(), timeout=2)
        index = {w.worker_id: set(w.block_hashes) for w in reply.workers if w.block_hashes}
        truth = {}
        # The workers' pools, and the cache instances' memory (T2), each as it serves it.
        for m in (m for m in members if m.role in (*WORKER_ROLES, ns.ROLE_CACHE)):
            async with grpc_util.channel(m.address) as ch:
                stub = (
                    cache_pb2_grpc.CacheStub(ch)
                    if m.role == ns.ROLE_CACHE
                    else worker_pb2_grpc.WorkerStub(ch)
                )
                snap = await stub.Snapshot(worker_pb2.KVSnapshotRequest(), timeout=2)
            if snap.block_hashes:
                truth[m.id] = set(snap.block_hashes)
        return index == truth

    async def held_blocks(self, timeout: float = 15.0) -> int:
        """Blocks the workers still hold once idle (0 within `timeout`: nothing leaked)."""
        deadline = time.monotonic() + timeout
        held = -1
        while time.monotonic() < deadline:
            workers = [m for m in await self.members() or [] if m.role in WORKER_ROLES]
            stats = [await self.worker_stats(m) for m in workers]
            if workers and all(s is not None for s in stats):
                held = sum(s.held_blocks + s.num_running + s.num_waiting for s in stats)
                if held == 0:
                    return 0
            await asyncio.sleep(0.2)
        return held


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples in a Prometheus exposition whose labels include `labels`."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (from /proc: its sockets' inodes)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _member_of(pid: int, members: list[ns.Member]) -> ns.Member | None:
    ports = listening_ports(pid)
    for m in members:
        if int(m.address.rsplit(":", 1)[1]) in ports:
            return m
    return None


def _roles(members: list[ns.Member]) -> Counter:
    return Counter(m.role for m in members)


# -- one fault -----------------------------------------------------------------------------------
async def run_fault(
    view: View, traffic: Traffic, fault: Fault, warm_s: float, tail_s: float
) -> Row:
    row = Row(fault.name)
    traffic.row = row
    await asyncio.sleep(warm_s)
    pid = view.pids(fault.process)[0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        missed_before = await view.heartbeats_missed(http)
    members = await view.members() or []
    victim = _member_of(pid, members)
    if victim is None and fault.process in MEMBERS:
        row.errors.append(f"{fault.process} pid {pid} is no registered member")
    if fault.phase and victim is not None:
        # Whichever of the role's workers is first seen in the phase is the victim.
        candidates = [(p, _member_of(p, members)) for p in view.pids(fault.process)]
        found = await _until_in(view, [(p, m) for p, m in candidates if m], fault.phase)
        row.caught = found is not None
        pid, victim = found or (pid, victim)
    started = time.monotonic()
    if fault.stop:
        os.kill(pid, signal.SIGSTOP)
        try:
            await _until_gone(view, victim, started + RECOVERY_TIMEOUT_S)
            await asyncio.sleep(max(0.0, started + STOP_TTLS * view.ttl - time.monotonic()))
        finally:
            os.kill(pid, signal.SIGCONT)
    else:
        os.kill(pid, signal.SIGKILL)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        deadline = started + RECOVERY_TIMEOUT_S
        why = None
        while time.monotonic() < deadline:
            why = await _unhealthy(view, fault, pid, victim)
            if why is None and not await view.probe(http, traffic.model_id):
                why = "the probe request was not served on a route the master chose"
            if why is None:
                row.recovery_s = time.monotonic() - started
                break
            await asyncio.sleep(0.1)
        if why is not None:
            row.errors.insert(0, f"not healthy after {RECOVERY_TIMEOUT_S:g} s: {why}")
        missed_after = await view.heartbeats_missed(http)
        same_nameservice = fault.process != "nameservice" or fault.stop
        if same_nameservice and missed_before is not None and missed_after is not None:
            row.expired = int(missed_after - missed_before)
    await asyncio.sleep(tail_s)
    traffic.row = None  # what still finishes counts in no phase
    return row


async def _until_in(
    view: View, candidates: list[tuple[int, ns.Member]], phase: str, timeout: float = 20.0
) -> tuple[int, ns.Member] | None:
    """The first of the candidate workers (pid, member) seen in `phase` ("busy",
    "transfer") within `timeout`, or None."""

    def inside(stats: worker_pb2.WorkerStats | None) -> bool:
        if stats is None:
            return False
        if phase == "busy":
            return stats.num_running + stats.num_waiting > 0
        return stats.kv_transfers_in_flight > 0

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = await asyncio.gather(*(view.worker_stats(m) for _, m in candidates))
        for candidate, stats in zip(candidates, seen, strict=True):
            if inside(stats):
                return candidate
        await asyncio.sleep(0.002)  # a prefill or a transfer lasts milliseconds here
    return None


async def _until_gone(view: View, victim: ns.Member | None, deadline: float) -> None:
    while victim is not None and time.monotonic() < deadline:
        members = await view.members()
        if members is not None and victim.id not in {m.id for m in members}:
            return
        await asyncio.sleep(0.05)


async def _unhealthy(view: View, fault: Fault, pid: int, victim: ns.Member | None) -> str | None:
    """Why routing is not healthy yet (None: the process is back, restarted or resumed, and
    the membership is whole again)."""
    pids = view.pids(fault.process)
    if not fault.stop and pid in pids:
        return f"{fault.process} not restarted yet"
    if not pids or not all(alive(p) for p in pids):
        return f"a {fault.process} process is not running"
    members = await view.members()
    if members is None:
        return "the nameservice does not answer"
    if _roles(members) != view.roles:
        return f"members by role {dict(_roles(members))}, expected {dict(view.roles)}"
    if victim is not None and not fault.stop and victim.id in {m.id for m in members}:
        return f"{victim.id} is still listed"
    if fault.process in MEMBERS and any(_member_of(p, members) is None for p in pids):
        return f"a {fault.process} process is not registered"
    return None


async def _settled(view: View) -> tuple[int, bool]:
    return await view.held_blocks(), await view.index_matches()


# -- the whole run ---------------------------------------------------------------------------------
def offline_reference(model: str, max_tokens: int) -> dict[str, str]:
    from rtp_serve.core.sampling_params import SamplingParams
    from rtp_serve.engine.llm import LLM

    llm = LLM(model, num_kv_blocks=256)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS + LONG_PROMPTS
    return {p: out.text for p, out in zip(prompts, llm.generate(prompts, params), strict=True)}


def topology_flags(topology: str) -> list[str]:
    kind, *counts = topology.split(":")
    if kind == "fused":
        return ["--fused", counts[0] if counts else "2"]
    prefill, decode = (counts + ["2", "2"])[:2]
    return ["--prefill", prefill, "--decode", decode, "--max-local-prefill-tokens", "0"]


async def _run_faults(
    view: View, traffic: Traffic, faults: list[Fault], args: argparse.Namespace
) -> list[Row]:
    stop = asyncio.Event()
    load = asyncio.create_task(traffic.run(args.clients, stop))
    rows = []
    try:
        for fault in faults:
            traffic.row = None
            row = await run_fault(view, traffic, fault, args.warm_s, args.tail_s)
            stop.set()  # traffic stops so the workers go idle: then leaks and the index show
            await load
            row.leaked_blocks, row.index_ok = await _settled(view)
            rows.append(row)
            stop = asyncio.Event()
            load = asyncio.create_task(traffic.run(args.clients, stop))
    finally:
        stop.set()
        await asyncio.gather(load, return_exceptions=True)
    return rows


def run(args: argparse.Namespace) -> list[Row]:
    from rtp_serve.models.make_model import resolve_model

    model = str(resolve_model(args.model))
    names = args.faults.split(",") if args.faults != "all" else None
    fused = args.topology.startswith("fused")
    faults = [FAULTS[n] for n in names or (ALL_FUSED if fused else ALL_PD)]
    reference = offline_reference(model, args.max_tokens)
    flags = ["--restart", "on-failure", "--ttl", str(args.ttl), "--kv-cache-mib", "128",
             *topology_flags(args.topology), *args.launcher_args.split()]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp, launch(model, Path(tmp), *flags) as c:
        view = View(c.url, Path(tmp) / "cluster.json", args.ttl)
        view.roles = expected_roles(args.topology)
        asyncio.run(_until_whole(view))
        traffic = Traffic(c.url, Path(model).name, reference, args.max_tokens)
        return asyncio.run(_run_faults(view, traffic, faults, args))


def expected_roles(topology: str) -> Counter:
    """Members by role of a whole cluster of `topology` (as topology_flags launches it)."""
    flags = topology_flags(topology)
    roles = Counter({ns.ROLE_MASTER: 1, ns.ROLE_CACHE: 1, ns.ROLE_FRONTEND: 1})
    for flag, role in (("--fused", ns.ROLE_FUSED), ("--prefill", ns.ROLE_PREFILL),
                       ("--decode", ns.ROLE_DECODE)):  # fmt: skip
        if flag in flags:
            roles[role] = int(flags[flags.index(flag) + 1])
    return roles


async def _until_whole(view: View, timeout: float = RECOVERY_TIMEOUT_S) -> None:
    """Until every process of the cluster has registered (`up` is ready with fewer)."""
    deadline = time.monotonic() + timeout
    while _roles(await view.members() or []) != view.roles:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster never had members by role {dict(view.roles)}")
        await asyncio.sleep(0.1)


def table(rows: list[Row]) -> str:
    head = f"{'fault':<16} {'requests':>8} {'failed':>6} {'wrong':>5} {'recovery':>9} "
    head += f"{'leaked':>6} {'index':>5} {'expired':>7} {'caught':>6}  pass"
    lines = [head]
    for r in rows:
        rec = f"{r.recovery_s:.2f} s" if r.recovery_s is not None else "never"
        ok = "yes" if r.passed(FAULTS[r.fault]) else "NO"
        lines.append(
            f"{r.fault:<16} {r.requests:>8} {r.failed:>6} {r.mismatched:>5} {rec:>9} "
            f"{r.leaked_blocks:>6} {'ok' if r.index_ok else 'NO':>5} "
            f"{'-' if r.expired is None else r.expired:>7} "
            f"{'-' if r.caught is None else 'yes' if r.caught else 'no':>6}  {ok}"
        )
        lines += [f"    {e}" for e in r.errors]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--topology", default="pd:2:2", help="pd:P:D or fused:K")
    p.add_argument("--faults", default="all", help=f"comma-separated, of {', '.join(FAULTS)}")
    p.add_argument("--clients", type=int, default=4, help="concurrent streams")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ttl", type=float, default=1.0, help="the nameservice's heartbeat TTL")
    p.add_argument("--warm-s", type=float, default=3.0, help="traffic before each fault")
    p.add_argument("--tail-s", type=float, default=3.0, help="traffic after recovery")
    p.add_argument("--launcher-args", default="", help="more flags for rtp-serve up")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--test-size", action="store_true", help="short phases (what CI runs)")
    args = p.parse_args(argv)
    if args.test_size:
        args.clients, args.max_tokens, args.warm_s, args.tail_s = 3, 16, 1.0, 1.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(f"cpu: {cpu_isa().describe()}")
    print(f"chaos: {args.topology}, {args.clients} streams of {args.max_tokens} tokens, "
          f"TTL {args.ttl:g} s, model {args.model}")  # fmt: skip
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0 if all(r.passed(FAULTS[r.fault]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
