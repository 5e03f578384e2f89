"""The master's prefix index alone, at a thousand workers and millions of blocks.

    python bench/index_size.py --workers 1000 --blocks 1000000,10000000 [--copies 2]
        [--reference]   # then the same in a child process with the old index, beside it

In this process, with the master's own PrefixIndex (services/master/prefix_index.py) fed
real rtp.v1.KVEvents messages (serialized and parsed, as NATS delivers them): prompts of
`--prompt-blocks` chained keys, each stored on `--copies` workers, until the index holds the
asked number of (worker, block) pairs. Per size it prints:
  - RSS growth per indexed pair, and where it goes (the index's parts);
  - the ingest rate of parse + apply (blocks/s), one 64-block batch at a time, and the
    share of it that is protobuf (parse, and `stored` read into a list);
  - `match_all` of a stored prompt over every worker (what cache_aware routing does
    first), p50/p99, and `match_holders` (the same, only the workers that hold some).
`--impl reference` measures tests/reference_prefix_index.py (two dicts of sets) instead.
No cluster, no NATS: an upper bound for what the master's index can do on this CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

from rtp_serve.services.common.pb import events_pb2  # noqa: E402
from rtp_serve.services.master.prefix_index import PrefixIndex  # noqa: E402
from tests.reference_prefix_index import SimplePrefixIndex  # noqa: E402

BATCH = 64  # blocks per KVEvents message (a worker's 10 ms of prefill, roughly)


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_flags() -> str:
    from rtp_serve.kernels.isa import bench_flags

    return bench_flags()


def prompt_keys(prompt: int, n: int) -> list[bytes]:
    keys, parent = [], b"\0" * 16
    for i in range(n):
        parent = hashlib.blake2b(parent + i.to_bytes(4, "little") + prompt.to_bytes(8, "little"),
                                 digest_size=16).digest()  # fmt: skip
        keys.append(parent)
    return keys


def fill(index, workers: list[str], target: int, args, rng, state) -> tuple[float, float, float]:
    """Store prompts until the index holds `target` pairs; seconds spent in parse + apply,
    of those in parse + reading `stored`, and CPU seconds in parse + apply."""
    spent = parsing = cpu = 0.0
    while True:
        began, began_cpu = time.perf_counter(), time.process_time()
        held = len(index)  # the compact index applies the batches it kept back
        spent += time.perf_counter() - began
        cpu += time.process_time() - began_cpu
        if held >= target:
            break
        keys = prompt_keys(state["prompt"], args.prompt_blocks)
        state["prompt"] += 1
        for worker in rng.sample(workers, args.copies):
            state["seq"][worker] = seq = state["seq"].get(worker, 0) + 1
            for start in range(0, len(keys), BATCH):
                wire = events_pb2.KVEvents(
                    worker_id=worker, seq=seq, stored=keys[start : start + BATCH]
                ).SerializeToString()
                began, began_cpu = time.perf_counter(), time.process_time()
                index.apply(events_pb2.KVEvents.FromString(wire))
                spent += time.perf_counter() - began
                cpu += time.process_time() - began_cpu
                if start == 0:  # sampled: parse + list(stored) alone
                    began = time.perf_counter()
                    list(events_pb2.KVEvents.FromString(wire).stored)
                    parsing += (time.perf_counter() - began) * len(keys) / BATCH
    return spent, parsing, cpu


def match_times(index, workers: list[str], args, rng, prompts: int) -> tuple[list, list, list]:
    """Seconds per call: match_all (wall, CPU), match_holders (wall)."""
    all_, cpu, holders = [], [], []
    for _ in range(200):
        keys = prompt_keys(rng.randrange(prompts), args.prompt_blocks)
        began, began_cpu = time.perf_counter(), time.process_time()
        index.match_all(keys, workers)
        all_.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
        if hasattr(index, "match_holders"):
            began = time.perf_counter()
            index.match_holders(keys)
            holders.append(time.perf_counter() - began)
    return sorted(all_), sorted(cpu), sorted(holders)


def p50_p99(times: list[float]) -> str:
    if not times:
        return "-"
    return f"{statistics.median(times) * 1e3:.2f} / {times[int(len(times) * 0.99) - 1] * 1e3:.2f}"


def where_it_goes(index) -> str:
    mib = 2**20
    if isinstance(index, PrefixIndex):
        parts = index.footprint()
        return ", ".join(f"{k} {v / mib:.0f} MiB" for k, v in parts.items())
    holder_sets = sum(sys.getsizeof(s) for s in index._holders.values())
    block_sets = sum(sys.getsizeof(s) for s in index._blocks.values())
    keys = len(index._holders) * sys.getsizeof(b"\0" * 16)
    return (f"holders dict {sys.getsizeof(index._holders) / mib:.0f} MiB, its per-block sets "
            f"{holder_sets / mib:.0f} MiB, per-worker sets {block_sets / mib:.0f} MiB, "
            f"16-byte keys as bytes objects {keys / mib:.0f} MiB")  # fmt: skip


def distinct(index) -> int:
    return index.distinct() if isinstance(index, PrefixIndex) else len(index._holders)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--blocks", default="1000000,10000000", help="indexed pairs, ascending")
    ap.add_argument("--copies", type=int, default=2, help="workers holding each prompt")
    ap.add_argument("--prompt-blocks", type=int, default=1000, help="keys per prompt")
    ap.add_argument("--impl", choices=["compact", "reference"], default="compact")
    ap.add_argument("--reference", action="store_true", help="then the reference, beside it")
    ap.add_argument("--no-header", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    workers = [f"fused-{i:04d}" for i in range(args.workers)]
    index = PrefixIndex() if args.impl == "compact" else SimplePrefixIndex()
    state = {"prompt": 0, "seq": {}}
    base = rss_bytes()
    if not args.no_header:
        print(f"# cpu flags: {cpu_flags()}; {os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.1f} at the start: shared, numbers are noisy")  # fmt: skip
        print(f"# {args.workers} workers, prompts of {args.prompt_blocks} blocks on {args.copies} "
              f"workers each, {BATCH}-block event batches")  # fmt: skip
        print(
            "| index | pairs | distinct blocks | RSS growth / pair (B) | ingest (blocks/s) "
            "| ingest (blocks / CPU-s) | of it protobuf | match_all over all workers "
            "p50 / p99 (ms) | the same in CPU time | match_holders p50 / p99 (ms) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
    done = 0
    for target in (int(x) for x in args.blocks.split(",")):
        seconds, parsing, cpu = fill(index, workers, target, args, rng, state)
        pairs = len(index)
        rate = (pairs - done) / seconds if seconds else 0.0
        cpu_rate = (pairs - done) / cpu if cpu else 0.0
        done = pairs
        per_pair = (rss_bytes() - base) / pairs
        all_, all_cpu, holders = match_times(index, workers, args, rng, state["prompt"])
        print(f"| {args.impl} | {pairs:,} | {distinct(index):,} | {per_pair:.0f} | {rate:,.0f} "
              f"| {cpu_rate:,.0f} | {parsing / seconds:.0%} | {p50_p99(all_)} "
              f"| {p50_p99(all_cpu)} | {p50_p99(holders)} |", flush=True)  # fmt: skip
    print(f"# {args.impl}, where it goes at {len(index):,} pairs: {where_it_goes(index)} "
          f"(load average {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
    if args.reference and args.impl == "compact":
        cmd = [sys.executable, __file__, "--impl", "reference", "--no-header"]
        cmd += ["--workers", str(args.workers), "--blocks", args.blocks]
        cmd += ["--copies", str(args.copies), "--prompt-blocks", str(args.prompt_blocks)]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
