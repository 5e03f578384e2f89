"""Read a local HuggingFace checkpoint's safetensors (one file or an indexed set of shards),
in file order.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte
range) and the tensors' bytes back to back. Each file is read front to back: its tensors are
taken in the order their bytes lie in the file and each is read straight into its own
freshly allocated tensor (large sequential reads, no copy in between, no page-cache mapping
kept alive). A device other than the CPU gets each tensor through one reused host staging
buffer (pinned on CUDA), then one copy to the device. Shards are read in parallel threads
when there are several and more than one core (file reads release the GIL). Checkpoints
over PROGRESS_BYTES log their progress.

The result is bit-identical to `safetensors.torch.load_file` (tests/test_weights.py).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PROGRESS_BYTES = 1 << 30  # bigger checkpoints log their progress
STAGING_BYTES = 64 << 20  # non-CPU devices: tensors pass through a buffer this large
_HEADER_LIMIT = 100 << 20  # safetensors' own bound on the JSON header
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_tensors(model_dir: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    files = checkpoint_files(model_dir)
    progress = _Progress(sum(f.stat().st_size for f in files), Path(model_dir).name)
    workers = min(len(files), os.cpu_count() or 1)
    tensors: dict[str, torch.Tensor] = {}
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="load") as pool:
            for part in pool.map(lambda f: read_file(f, device, progress), files):
                tensors.update(part)
    else:
        for f in files:
            tensors.update(read_file(f, device, progress))
    progress.done()
    return tensors


def read_file(
    path: Path, device: str = "cpu", progress: _Progress | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, read front to back."""
    target = torch.device(device)
    with open(path, "rb", buffering=0) as f:
        entries, data_start = _header(f, path)
        staging = _Staging(target) if target.type != "cpu" else None
        out: dict[str, torch.Tensor] = {}
        position = data_start
        for name, dtype, shape, begin, end in entries:
            if data_start + begin != position:
                f.seek(data_start + begin)
            host = staging.take(dtype, shape) if staging else torch.empty(shape, dtype=dtype)
            _read_into(f, host, end - begin, path, name)
            out[name] = host.to(target, copy=True) if staging else host
            position = data_start + end
            if progress is not None:
                progress.add(end - begin)
        return out


def _header(f, path: Path) -> tuple[list[tuple[str, torch.dtype, list[int], int, int]], int]:
    """The file's tensors in the order their bytes lie in it, and where the bytes start."""
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
    (size,) = struct.unpack("<Q", raw)
    if size > _HEADER_LIMIT:
        raise ValueError(f"{path}: header of {size} bytes is larger than safetensors allows")
    header = json.loads(f.read(size))
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        entries.append((name, _DTYPES[info["dtype"]], list(info["shape"]), begin, end))
    entries.sort(key=lambda e: e[3])
    return entries, 8 + size


def _read_into(f, tensor: torch.Tensor, nbytes: int, path: Path, name: str) -> None:
    expected = tensor.numel() * tensor.element_size()
    if nbytes != expected:
        raise ValueError(f"{path}: tensor {name} has {nbytes} bytes, its shape needs {expected}")
    if nbytes == 0:
        return
    view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < nbytes:
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"{path}: file ends inside tensor {name}")
        done += got


class _Staging:
    """One host buffer reused for every tensor of a file on its way to the device."""

    def __init__(self, device: torch.device) -> None:
        self.pin = device.type == "cuda"
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def take(self, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self.buffer.numel():
            size = max(nbytes, STAGING_BYTES)
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        return self.buffer[:nbytes].view(dtype).view(shape)


class _Progress:
    """Logs every 10% of a big checkpoint read (shards may be read by several threads)."""

    def __init__(self, total: int, name: str) -> None:
        self.total, self.name = total, name
        self.read = 0
        self.logged = 0
        self.started = time.perf_counter()
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        if self.total < PROGRESS_BYTES:
            return
        with self._lock:
            self.read += nbytes
            tenth = self.read * 10 // self.total
            if tenth > self.logged:
                self.logged = tenth
                log.info("loading %s: %d%% of %.1f GiB", self.name, tenth * 10, self.total / 2**30)

    def done(self) -> None:
        if self.total >= PROGRESS_BYTES:
            seconds = time.perf_counter() - self.started
            log.info("loaded %s: %.1f GiB in %.1f s", self.name, self.total / 2**30, seconds)
