"""Model loading: time from nothing to a ready engine, ours vs transformers, cold and warm;
and the time `rtp-serve up` takes to be ready.

    python bench/load.py                                  # llama-100m and llama-1b (sharded)
    python bench/load.py --models llama-100m --trials 3 --up

Each timing is a fresh Python process (imports excluded: the clock starts once torch and
the project are imported), as a worker starting up would be:

  ours   engine.llm_engine.LLMEngine(EngineConfig(model, small KV)): reads the safetensors
         in file order (engine/weights.py), fuses, allocates the KV pool, ready to step
  hf     transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=float32)
  fst    ours with --load-format fastsafetensors (where that package is installed)

  read   every file read front to back with plain reads and nothing else: the floor for
         any loader (cold, the storage's own rate; no loader can beat it, so cold the
         hf/ours ratio is bounded by hf/read)

cold: the checkpoint's pages are dropped from the page cache first (posix_fadvise
DONTNEED on every file: no root needed; the disk read is then real unless the storage has
its own cache); warm: dropped and read once with plain reads just before. `--up`: seconds from `rtp-serve up` (the default
model, smollm2-135m, in the default PD layout) to ready, with the CPU kernels compiled at
install (ours) and, as before, compiled by each worker on first use: found in torch's cache,
and afresh (a new TORCH_EXTENSIONS_DIR), which is what a fresh install cost on first start.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent  # run as a script: the repository root first
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

from rtp_serve.kernels.isa import cpu_isa  # noqa: E402

_ONE = """
import json, sys, time
import torch
kind, model = sys.argv[1], sys.argv[2]
torch.set_num_threads(int(sys.argv[3]))
if kind != "hf":
    from rtp_serve.engine.config import EngineConfig
    from rtp_serve.engine.llm_engine import LLMEngine
    how = "auto" if kind == "ours" else kind
    start = time.perf_counter()
    LLMEngine(EngineConfig(model=model, num_kv_blocks=64, num_threads=int(sys.argv[3]),
                           load_format=how))
else:
    from transformers import AutoModelForCausalLM
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def drop_page_cache(model_dir: Path) -> None:
    for path in model_dir.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm_page_cache(model_dir: Path) -> None:
    """Dropped, then read with plain reads (as `cat` would): the same page cache for every
    warm trial, whoever loaded the model before (a mapped read with huge pages leaves 2 MiB
    folios that map faster than what a plain read leaves)."""
    drop_page_cache(model_dir)
    for path in model_dir.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass


def time_one(kind: str, model_dir: Path, cold: bool, threads: int) -> float:
    (drop_page_cache if cold else warm_page_cache)(model_dir)
    if kind == "read":
        return time_read(model_dir)
    out = subprocess.run(
        [sys.executable, "-c", _ONE, kind, str(model_dir), str(threads)],
        capture_output=True,
        text=True,
        check=True,
        cwd=_ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def time_read(model_dir: Path) -> float:
    """Seconds to read every file of the checkpoint front to back with plain 64 MiB reads
    into one buffer, and do nothing else: the floor for any loader (cold, the storage's
    sequential rate; warm, a copy out of the page cache)."""
    buf = bytearray(64 << 20)
    start = time.perf_counter()
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    return time.perf_counter() - start


# `--up` cells: how the CPU kernels reach the workers. "installed" is ours (compiled by the
# install, rtp_serve/kernels/cpu.py only imports them); the two "jit" ones are how it was before, the
# kernels compiled on a worker's first start (afresh: a new TORCH_EXTENSIONS_DIR, what a
# fresh install cost) or found in torch's cache from an earlier start.
UP_CELLS = {
    "installed (ours)": {},
    "jit, cached (before, warm)": {"RTP_SERVE_CPU_KERNELS": "jit"},
    "jit, afresh (before, fresh install)": {"RTP_SERVE_CPU_KERNELS": "jit", "fresh": "1"},
}


def time_up(model: str, cell: dict[str, str]) -> float:
    """Seconds from `rtp-serve up` (default PD layout) to ready, in a clean environment."""
    from rtp_serve.services.launcher.process import launch

    saved = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="load-up-") as tmp:
        try:
            os.environ.pop("RTP_SERVE_CPU_KERNELS", None)
            os.environ.update({k: v for k, v in cell.items() if k != "fresh"})
            if "fresh" in cell:
                os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(tmp) / "torch_extensions")
            start = time.perf_counter()
            with launch(model, Path(tmp), "--kv-cache-mib", "64"):
                return time.perf_counter() - start
        finally:
            os.environ.clear()
            os.environ.update(saved)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="llama-100m,llama-1b")
    ap.add_argument("--trials", type=int, default=2, help="per cell; the median is shown")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--up", action="store_true", help="also time rtp-serve up to ready")
    ap.add_argument("--up-model", default="smollm2-135m", help="the model --up serves")
    ap.add_argument("--skip-load", action="store_true", help="only --up")
    args = ap.parse_args()
    from rtp_serve.models.make_model import resolve_model

    print(f"cpu: {cpu_isa().describe()}; load average {os.getloadavg()[0]:.1f}")
    kinds = ["read", "ours", "hf"]
    if importlib.util.find_spec("fastsafetensors") is not None:
        kinds.append("fastsafetensors")
    fst = "fastsafetensors" in kinds
    print(f"{'model':12} {'size':>8} {'cache':>5} {'read s':>7} {'ours s':>8} {'hf s':>8} "
          f"{'hf/ours':>8} {'ours/read':>9}"
          + (f" {'fst s':>8}" if fst else ""))  # fmt: skip
    for name in [] if args.skip_load else args.models.split(","):
        model_dir = Path(resolve_model(name))
        os.sync()  # a preset built just now: its pages written back before any timing
        size = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
        for cold in (True, False):
            cells = {}
            for kind in kinds:
                runs = [time_one(kind, model_dir, cold, args.threads) for _ in range(args.trials)]
                cells[kind] = statistics.median(runs)
            print(f"{name:12} {size / 2**30:>6.2f}Gi {'cold' if cold else 'warm':>5} "
                  f"{cells['read']:>7.2f} {cells['ours']:>8.2f} {cells['hf']:>8.2f} "
                  f"{cells['hf'] / cells['ours']:>7.1f}x {cells['ours'] / cells['read']:>8.1f}x"
                  + (f" {cells['fastsafetensors']:>8.2f}" if fst else ""), flush=True)  # fmt: skip
    if args.up:
        print(f"rtp-serve up --model {args.up_model} (1 prefill, 1 decode) to ready, "
              f"median of {args.trials}; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        for what, cell in UP_CELLS.items():
            runs = [time_up(args.up_model, cell) for _ in range(args.trials)]
            print(f"  kernels {what:38} {statistics.median(runs):6.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
