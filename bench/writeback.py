"""What writing one prompt's KV back to the remote tier costs the worker's serving loop, stage
by stage, on the blocks of a real model's shape.

    python bench/writeback.py [--model llama-100m] [--tokens 270] [--dtype float32] [--reps 5]
                              [--rounds 2]

A fused or prefill worker with a cache tier writes the KV of each prompt it computed back to
the cache service (services/worker/tiers.py, services/cache/client.py). Everything here but
the seal runs on the serving loop's thread, on the cores the engine computes on:

  split        the prompt's KV cut into KVBlock messages (services/worker/kv_wire.py)
  seal         each block's integrity tag, SHA-256 over its payload (in a worker thread,
               hashlib releasing the GIL)
  batch        the blocks grouped into Put requests under the size limit: measured with
               protobuf's ByteSize() (before) and with the payload's length (now,
               services/common/kv_block_size.py), side by side
  request      the PutRequest built from the blocks (protobuf copies each one)
  serialize    the request's bytes, as gRPC sends them

Each stage is timed in fresh processes with glibc's malloc as it comes and with freed memory
kept (services/common/heap.py, what workers and the cache service run with): buffers this
large otherwise come from new mappings whose pages fault on first touch. Medians of `--reps`
calls, then of `--rounds` processes per setting, alternated; milliseconds, with the KV's
size and the CPU's flags. Wall-clock on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.kv_blocks import median_us  # noqa: E402
from rtp_serve.core.model_config import ModelConfig  # noqa: E402
from rtp_serve.engine.outputs import PromptKV  # noqa: E402
from rtp_serve.kernels.isa import bench_flags, cpu_isa  # noqa: E402
from rtp_serve.models.make_model import resolve_model  # noqa: E402
from rtp_serve.services.cache import client  # noqa: E402
from rtp_serve.services.cache.integrity import KVIntegrity  # noqa: E402
from rtp_serve.services.common.heap import keep_freed_memory  # noqa: E402
from rtp_serve.services.common.pb import cache_pb2  # noqa: E402
from rtp_serve.services.worker.kv_wire import split_blocks  # noqa: E402

BLOCK = 16


def batch_by_bytesize(blocks: list) -> list[list]:
    """The batching as it was: each block measured by protobuf's ByteSize()."""
    batches: list[list] = [[]]
    size = 0
    for block in blocks:
        n = block.ByteSize()
        if batches[-1] and size + n > client._MAX_PUT_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(block)
        size += n
    return batches


HEAPS = ("glibc", "kept")


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Median ms of each stage, in this process."""
    cfg = ModelConfig.from_dir(resolve_model(args.model))
    dtype = getattr(torch, args.dtype)
    full = args.tokens // BLOCK * BLOCK  # the blocks a write-back keeps: full ones
    shape = (cfg.num_layers, full, cfg.num_kv_heads, cfg.head_dim)
    kv = PromptKV(0, torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    hashes = [i.to_bytes(16, "little") for i in range(full // BLOCK)]
    integrity = KVIntegrity()

    blocks = split_blocks(kv, BLOCK, hashes)
    for b in blocks:
        integrity.seal(b)
    batches = client._batches(blocks)
    request = cache_pb2.PutRequest(blocks=batches[0])
    stages = {
        "split": lambda: split_blocks(kv, BLOCK, hashes),
        "seal": lambda: [integrity.seal(b) for b in blocks],
        "batch, ByteSize (before)": lambda: batch_by_bytesize(blocks),
        "batch, payload length (now)": lambda: client._batches(blocks),
        "request": lambda: [cache_pb2.PutRequest(blocks=b) for b in batches],
        "serialize": request.SerializeToString,
    }
    times = {name: median_us(fn, args.reps) / 1e3 for name, fn in stages.items()}
    times["blocks"] = len(blocks)
    times["MiB"] = 2 * kv.k.numel() * kv.k.element_size() / 2**20
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--tokens", type=int, default=270)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="fresh processes per heap, alternated")
    ap.add_argument("--heap", choices=HEAPS, help=argparse.SUPPRESS)  # one measuring child
    args = ap.parse_args()
    if args.heap:
        if args.heap == "kept" and not keep_freed_memory():
            raise SystemExit("this libc took no heap thresholds")
        print(json.dumps(measure(args)))
        return
    runs: dict[str, list[dict[str, float]]] = {heap: [] for heap in HEAPS}
    for _ in range(args.rounds):
        for heap in HEAPS:
            argv = [sys.executable, __file__, "--heap", heap, "--model", args.model,
                    "--tokens", str(args.tokens), "--dtype", args.dtype, "--reps", str(args.reps)]  # fmt: skip
            out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
            runs[heap].append(json.loads(out.splitlines()[-1]))
    first = runs["glibc"][0]
    print(f"cpu: {cpu_isa().describe()}; bench flags: {bench_flags()}")
    print(f"model {args.model}: {first['blocks']:.0f} blocks of {BLOCK} tokens, {args.dtype}, "
          f"{first['MiB']:.1f} MiB of K and V; ms, medians of {args.reps} calls, then of "
          f"{args.rounds} processes per heap (alternated)")  # fmt: skip
    print(f"  {'stage':<28} {'glibc defaults':>15} {'memory kept':>12}")
    med = {h: {k: statistics.median(r[k] for r in runs[h]) for k in first} for h in HEAPS}
    for name in first:
        if name not in ("blocks", "MiB"):
            print(f"  {name:<28} {med['glibc'][name]:15.2f} {med['kept'][name]:12.2f}")
    loop = [k for k in first if k not in ("blocks", "MiB", "seal") and "before" not in k]
    g, k = (sum(med[h][name] for name in loop) for h in HEAPS)
    print(f"  {'loop thread (all but seal)':<28} {g:15.2f} {k:12.2f}  ({k / g:.2f}x)")


if __name__ == "__main__":
    main()
