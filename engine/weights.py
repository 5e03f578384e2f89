"""Read a local HuggingFace checkpoint's safetensors (one file or an indexed set of shards),
in file order.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte
range) and the tensors' bytes back to back. Two ways in, the same tensors out:

  mapped (the CPU)  each file is mapped copy-on-write and its pages are brought in front to
                    back (MADV_POPULATE_READ, or a read of each page where the kernel lacks
                    it: sequential reads with read-ahead when the file is not cached); each
                    tensor is a view of the mapping. The mapping asks for huge pages
                    (MADV_HUGEPAGE): the kernel then reads a cold file into 2 MiB page-cache
                    folios and maps each with one page-table entry, so a later load maps
                    4 GB in milliseconds instead of faulting in a million 4 KiB pages.
                    Nothing is copied, workers serving one model on one machine share its
                    pages, and a write to a weight (none is expected) changes only the
                    writer's own copy of that page.
  read (devices)    each file is read front to back, its tensors in the order their bytes
                    lie in it: on the CPU straight into fresh tensors, for a device through
                    one reused host staging buffer (pinned on CUDA), then one copy to it.

Shards are taken in parallel threads when there are several and more than one core (page
faults and file reads release the GIL). Checkpoints over PROGRESS_BYTES log their progress.

Tensors a model fuses (a layer's q, k and v; gate and up) are best back to back in memory,
so the model takes the fused weight as it is (`joined`) instead of concatenating copies.
Mapped, those the file stores adjacent already are (a layer's gate and up, as HF writes
them); read, the groups named in `fuse` are read straight into their rows of one allocation.

A third way, where the `fastsafetensors` package is installed (the `gpu` extra), is
`load_format="fastsafetensors"`: its loader copies each file whole onto the device (with
GPUDirect Storage where there is one).

The result is bit-identical to `safetensors.torch.load_file` (tests/test_weights.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import torch

from rtp_serve.engine.config import LOAD_FORMATS

log = logging.getLogger(__name__)

PROGRESS_BYTES = 1 << 30  # bigger checkpoints log their progress
STAGING_BYTES = 64 << 20  # non-CPU devices: tensors pass through a buffer this large
_HEADER_LIMIT = 100 << 20  # safetensors' own bound on the JSON header
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; Python 3.14 names it
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
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


def load_tensors(
    model_dir: str | Path,
    device: str = "cpu",
    fuse: Iterable[Sequence[str]] = (),
    load_format: str = "auto",
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by `load_format` (LOAD_FORMATS): "mmap" (what "auto"
    is on the CPU), "read" (what it is on a device) or "fastsafetensors". Read, those of
    each group in `fuse` come as adjacent rows of one allocation (where they share a dtype
    and all but the first dimension)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    on_cpu = torch.device(device).type == "cpu"
    if load_format == "auto":
        load_format = "mmap" if on_cpu else "read"
    if load_format == "mmap" and not on_cpu:
        raise ValueError(f"only the CPU can use a mapped checkpoint, not {device}")
    mapped = load_format == "mmap"
    files = checkpoint_files(model_dir)
    if load_format == "fastsafetensors":
        return load_fastsafetensors(files, device)
    headers = {}
    for path in files:
        with open(path, "rb", buffering=0) as f:
            headers[path] = _header(f, path)
    entries = [e for file_entries, _ in headers.values() for e in file_entries]
    places = {} if mapped else _places(entries, fuse, device)
    progress = _Progress(sum(f.stat().st_size for f in files), Path(model_dir).name)
    workers = min(len(files), os.cpu_count() or 1)
    tensors: dict[str, torch.Tensor] = {}

    def one(path: Path) -> dict[str, torch.Tensor]:
        if mapped:
            return map_file(path, progress, headers[path])
        return read_file(path, device, progress, places, headers[path])

    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="load") as pool:
            for part in pool.map(one, files):
                tensors.update(part)
    else:
        for f in files:
            tensors.update(one(f))
    progress.done()
    return tensors


def load_fastsafetensors(files: Sequence[Path], device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the files through the `fastsafetensors` package (the `gpu` extra):
    each file copied whole into one buffer on `device` (with GPUDirect Storage where the
    GPU and file system have it, else through its own bounce buffer), the tensors views of
    it. Bit-identical to the other ways in."""
    try:
        from fastsafetensors import SafeTensorsFileLoader, cpp
    except ImportError as e:
        raise RuntimeError(
            "load_format fastsafetensors needs the fastsafetensors package "
            "(pip install 'rtp-serve[gpu]')"
        ) from e
    target = torch.device(device)
    gds = target.type == "cuda" and cpp.is_cufile_found()
    log.info("loading %d file(s) with fastsafetensors (%s)", len(files), "GDS" if gds else "no GDS")
    loader = SafeTensorsFileLoader(None, str(target), nogds=not gds)
    try:
        loader.add_filenames({0: [str(f) for f in files]})
        buffer = loader.copy_files_to_device()
        try:  # the tensors keep their buffer alive after it is closed
            return {name: buffer.get_tensor(name) for name in loader.get_keys()}
        finally:
            buffer.close()
    finally:
        loader.close()


def back_to_back(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The parts concatenated on their first dimension as a view of the memory they share,
    where they lie back to back in order in one storage (placed so by the reader, or so
    stored in a mapped file); else None."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    if all(
        p.is_contiguous()
        and p.dim() >= 1
        and p.dtype == first.dtype
        and p.shape[1:] == first.shape[1:]
        and p.untyped_storage().data_ptr() == storage
        for p in parts
    ) and all(a.data_ptr() + a.nbytes == b.data_ptr() for a, b in pairwise(parts)):
        rows = sum(p.shape[0] for p in parts)
        return first.as_strided([rows, *first.shape[1:]], first.stride(), first.storage_offset())
    return None


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts concatenated on their first dimension: `back_to_back` where it can, else
    a new tensor."""
    if len(parts) == 1:
        return parts[0]
    view = back_to_back(parts)
    return view if view is not None else torch.cat(list(parts))


def map_file(
    path: Path, progress: _Progress | None = None, header: tuple[list[_Entry], int] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file as a view of its copy-on-write mapping, the
    pages brought in front to back first. A tensor whose bytes are not aligned to its dtype
    (no writer here makes one) is copied out."""
    with open(path, "rb", buffering=0) as f:
        entries, data_start = header or _header(f, path)
        size = os.fstat(f.fileno()).st_size
        view = mmap.mmap(
            f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    for name, _, _, _, end in entries:
        if data_start + end > size:
            raise ValueError(f"{path}: file ends inside tensor {name}")
    # 2 MiB page-cache folios map with one entry each, and a cold read fills them so; a
    # kernel without transparent huge pages refuses the advice.
    with contextlib.suppress(OSError):
        view.madvise(_MADV_HUGEPAGE)
    _populate(view, progress)
    whole = torch.frombuffer(view, dtype=torch.uint8)  # the tensors keep the mapping alive
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, begin, end in entries:
        _check_size(path, name, dtype, shape, end - begin)
        raw = whole[data_start + begin : data_start + end]
        if (data_start + begin) % dtype.itemsize:
            raw = raw.clone()
        out[name] = raw.view(dtype).view(shape)
    return out


def _populate(view: mmap.mmap, progress: _Progress | None) -> None:
    """Bring every page of the mapping in, in order, without copying it (a read fault maps
    the page cache's own page), in chunks so progress can be logged."""
    chunk = 256 << 20
    page = mmap.PAGESIZE
    for start in range(0, len(view), chunk):
        length = min(chunk, len(view) - start)
        try:
            view.madvise(_MADV_POPULATE_READ, start, length)
        except OSError:  # an older kernel: touch one byte of each page
            sum(memoryview(view)[start : start + length : page])
        if progress is not None:
            progress.add(length)


def read_file(
    path: Path,
    device: str = "cpu",
    progress: _Progress | None = None,
    places: dict[str, torch.Tensor] | None = None,
    header: tuple[list[_Entry], int] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, read front to back; a tensor named in `places`
    into the tensor given there (on `device`)."""
    target = torch.device(device)
    places = places or {}
    with open(path, "rb", buffering=0) as f:
        entries, data_start = header or _header(f, path)
        staging = _Staging(target) if target.type != "cpu" else None
        out: dict[str, torch.Tensor] = {}
        position = -1
        for name, dtype, shape, begin, end in entries:
            if data_start + begin != position:
                f.seek(data_start + begin)
            place = places.get(name)
            if staging:
                host = staging.take(dtype, shape)
                _read_into(f, host, end - begin, path, name)
                out[name] = host.to(target, copy=True) if place is None else place.copy_(host)
            else:
                out[name] = torch.empty(shape, dtype=dtype) if place is None else place
                _read_into(f, out[name], end - begin, path, name)
            position = data_start + end
            if progress is not None:
                progress.add(end - begin)
        return out


_Entry = tuple[str, torch.dtype, list[int], int, int]  # name, dtype, shape, begin, end


def _places(
    entries: list[_Entry], fuse: Iterable[Sequence[str]], device: str
) -> dict[str, torch.Tensor]:
    """For each group that can be fused, its tensors as consecutive rows of one allocation."""
    by_name = {e[0]: e for e in entries}
    places: dict[str, torch.Tensor] = {}
    for group in fuse:
        parts = [by_name.get(name) for name in group]
        if any(p is None or not p[2] for p in parts):
            continue  # not in this checkpoint (or a scalar): each is read on its own
        if len({(p[1], tuple(p[2][1:])) for p in parts}) != 1:
            continue  # mixed dtypes or row shapes: the model concatenates (and converts)
        rows = [p[2][0] for p in parts]
        slab = torch.empty([sum(rows), *parts[0][2][1:]], dtype=parts[0][1], device=device)
        places.update(zip(group, slab.split(rows), strict=True))
    return places


def _header(f, path: Path) -> tuple[list[_Entry], int]:
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


def _check_size(path: Path, name: str, dtype: torch.dtype, shape: list[int], nbytes: int) -> None:
    expected = torch.Size(shape).numel() * dtype.itemsize
    if nbytes != expected:
        raise ValueError(f"{path}: tensor {name} has {nbytes} bytes, its shape needs {expected}")


def _read_into(f, tensor: torch.Tensor, nbytes: int, path: Path, name: str) -> None:
    _check_size(path, name, tensor.dtype, list(tensor.shape), nbytes)
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
