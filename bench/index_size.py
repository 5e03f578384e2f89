"""The master's prefix index alone, at a thousand workers and millions of blocks.

    python bench/index_size.py --workers 1000 --blocks 1000000,10000000 [--copies 2]

In this process, with the master's own PrefixIndex (services/master/prefix_index.py) fed
real rtp.v1.KVEvents messages (serialized and parsed, as NATS delivers them): prompts of
`--prompt-blocks` chained keys, each stored on `--copies` workers, until the index holds the
asked number of (worker, block) pairs. Per size it prints:
  - RSS growth per indexed pair, and where it goes (the two maps' containers, the keys);
  - the ingest rate of parse + apply (blocks/s), one 64-block batch at a time;
  - `match_all` of a prompt over every worker (what cache_aware routing does first), p50/p99.
No cluster, no NATS: an upper bound for what the master's index can do on this CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

from rtp_serve.services.common.pb import events_pb2  # noqa: E402
from rtp_serve.services.master.prefix_index import PrefixIndex  # noqa: E402

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


def fill(index: PrefixIndex, workers: list[str], target: int, args, rng, state) -> float:
    """Store prompts until the index holds `target` pairs; seconds spent in parse + apply."""
    spent = 0.0
    while len(index) < target:
        keys = prompt_keys(state["prompt"], args.prompt_blocks)
        state["prompt"] += 1
        for worker in rng.sample(workers, args.copies):
            state["seq"][worker] = seq = state["seq"].get(worker, 0) + 1
            for start in range(0, len(keys), BATCH):
                wire = events_pb2.KVEvents(
                    worker_id=worker, seq=seq, stored=keys[start : start + BATCH]
                ).SerializeToString()
                began = time.perf_counter()
                index.apply(events_pb2.KVEvents.FromString(wire))
                spent += time.perf_counter() - began
    return spent


def match_times(index: PrefixIndex, workers: list[str], args, rng, prompts: int) -> list[float]:
    out = []
    for _ in range(200):
        keys = prompt_keys(rng.randrange(prompts), args.prompt_blocks)
        began = time.perf_counter()
        index.match_all(keys, workers)
        out.append(time.perf_counter() - began)
    return sorted(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--blocks", default="1000000,10000000", help="indexed pairs, ascending")
    ap.add_argument("--copies", type=int, default=2, help="workers holding each prompt")
    ap.add_argument("--prompt-blocks", type=int, default=1000, help="keys per prompt")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    workers = [f"fused-{i:04d}" for i in range(args.workers)]
    index = PrefixIndex()
    state = {"prompt": 0, "seq": {}}
    base = rss_bytes()
    print(f"# cpu flags: {cpu_flags()}; {os.cpu_count()} cores, shared: numbers are noisy")
    print(f"# {args.workers} workers, prompts of {args.prompt_blocks} blocks on {args.copies} "
          f"workers each, {BATCH}-block event batches")  # fmt: skip
    print(
        "| pairs | unique blocks | RSS growth / pair (B) | ingest (blocks/s) "
        "| match_all over all workers p50 / p99 (ms) |"
    )
    print("|---|---|---|---|---|")
    done = 0
    for target in (int(x) for x in args.blocks.split(",")):
        seconds = fill(index, workers, target, args, rng, state)
        pairs = len(index)
        rate = (pairs - done) / seconds if seconds else 0.0
        done = pairs
        per_pair = (rss_bytes() - base) / pairs
        times = match_times(index, workers, args, rng, state["prompt"])
        p50, p99 = statistics.median(times), times[int(len(times) * 0.99) - 1]
        print(f"| {pairs:,} | {len(index._holders):,} | {per_pair:.0f} | {rate:,.0f} "
              f"| {p50 * 1e3:.2f} / {p99 * 1e3:.2f} |", flush=True)  # fmt: skip
    unique = len(index._holders)
    holder_sets = sum(sys.getsizeof(s) for s in index._holders.values())
    block_sets = sum(sys.getsizeof(s) for s in index._blocks.values())
    keys = unique * sys.getsizeof(b"\0" * 16)
    print(f"# where it goes at {len(index):,} pairs: holders dict {sys.getsizeof(index._holders) / 2**20:.0f} MiB, "
          f"its per-block sets {holder_sets / 2**20:.0f} MiB, per-worker sets {block_sets / 2**20:.0f} MiB, "
          f"16-byte keys as bytes objects {keys / 2**20:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
