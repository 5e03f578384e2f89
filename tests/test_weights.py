"""The checkpoint loader (engine/weights.py), mapped, read and through fastsafetensors,
gives exactly what safetensors' own loader gives: same names, dtypes, shapes and bits, for
one file and for shards, in float32, bfloat16 and the integer and float8 dtypes; and
refuses broken files clearly. Mapped tensors are views of the file, and writing one never
reaches the file."""

from __future__ import annotations

import json
import os
import struct
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from rtp_serve.engine import SamplingParams, weights
from rtp_serve.engine.config import EngineConfig
from rtp_serve.engine.weights import load_tensors, map_file, read_file
from rtp_serve.models.checkpoint_writer import save_weights
from tests.helpers import make_llm


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), name
        assert torch.equal(g.view(-1).view(torch.uint8), w.view(-1).view(torch.uint8)), name


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(64, 48, generator=g),
        "b.weight": torch.randn(17, 5, generator=g).bfloat16(),
        "c.half": torch.randn(3, 3, generator=g).half(),
        "d.ids": torch.arange(-5, 20, dtype=torch.int64),
        "e.q": torch.randint(-128, 127, (40,), dtype=torch.int8, generator=g),
        "f.mask": torch.tensor([True, False, True]),
        "g.fp8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "h.scalar": torch.tensor(3.5),
        "i.empty": torch.empty(0, 4),
    }


def test_one_file_of_every_dtype_reads_bit_identical(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_mixed(), path, metadata={"format": "pt"})
    _same(read_file(path), load_file(path))
    _same(map_file(path), load_file(path))
    _same(load_tensors(tmp_path), load_file(path))
    _same(load_tensors(tmp_path, load_format="read"), load_file(path))
    _same(load_tensors(tmp_path, load_format="mmap"), load_file(path))


def test_mapped_tensors_are_views_of_the_file_that_writes_never_reach(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(2048, 1024), "b": torch.zeros(3)}, path)  # 8 MiB: huge pages
    before = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)  # out of the page cache: the mapping reads it afresh
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    got = map_file(path)
    assert got["a"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()
    got["a"].mul_(3.0)  # copy-on-write: this process's pages only
    assert torch.equal(got["a"], torch.full((2048, 1024), 3.0))
    assert path.read_bytes() == before
    assert torch.equal(map_file(path)["a"], torch.ones(2048, 1024))


@pytest.mark.parametrize("load_format", ["auto", "read", "fastsafetensors"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_in_shards_reads_bit_identical(model_dir, tmp_path, dtype, load_format):
    if load_format == "fastsafetensors":
        pytest.importorskip("fastsafetensors")
    base = model_dir("tiny-llama")
    want = {k: v.to(dtype) for k, v in load_file(base / "model.safetensors").items()}
    out = tmp_path / "sharded"
    out.mkdir()
    save_weights(sorted(want.items()), out, max_shard_bytes=256 << 10)
    shards = weights.checkpoint_files(out)
    assert len(shards) > 3  # really sharded: read in parallel where there are cores
    _same(load_tensors(out, load_format=load_format), want)


def test_fastsafetensors_reads_every_dtype_bit_identical(tmp_path):
    pytest.importorskip("fastsafetensors")
    path = tmp_path / "model.safetensors"
    save_file(_mixed(), path, metadata={"format": "pt"})
    _same(load_tensors(tmp_path, load_format="fastsafetensors"), load_file(path))


def test_a_missing_fastsafetensors_or_an_unknown_format_is_a_clear_error(tmp_path, monkeypatch):
    save_file({"w": torch.ones(4, 4)}, tmp_path / "model.safetensors")
    monkeypatch.setitem(sys.modules, "fastsafetensors", None)  # as if not installed
    with pytest.raises(RuntimeError, match="needs the fastsafetensors package"):
        load_tensors(tmp_path, load_format="fastsafetensors")
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_tensors(tmp_path, load_format="pickle")
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig(model=str(tmp_path), load_format="pickle")


def test_broken_files_are_refused_by_name(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4, 4)}, path)
    data = path.read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[:-10])  # cut inside the tensor
    for load in (read_file, map_file):
        with pytest.raises(ValueError, match="ends inside tensor w"):
            load(tmp_path / "short.safetensors")
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    header["w"]["dtype"] = "C64"
    raw = json.dumps(header).encode()
    (tmp_path / "odd.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size :])
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01")
    for load in (read_file, map_file):
        with pytest.raises(ValueError, match="unsupported dtype C64"):
            load(tmp_path / "odd.safetensors")
        with pytest.raises(ValueError, match="not a safetensors file"):
            load(tmp_path / "tiny.safetensors")


def test_fused_groups_are_read_back_to_back_and_joined_without_a_copy(tmp_path):
    """Read: the groups named are placed back to back, wherever the file has them."""
    g = torch.Generator().manual_seed(1)
    want = {
        "q": torch.randn(8, 6, generator=g),
        "k": torch.randn(4, 6, generator=g),
        "v": torch.randn(4, 6, generator=g),
        "gate": torch.randn(5, 6, generator=g).bfloat16(),
        "up": torch.randn(5, 6, generator=g),  # another dtype: cannot share an allocation
        "o": torch.randn(6, 8, generator=g),
    }
    out = tmp_path / "sharded"
    out.mkdir()
    save_weights(sorted(want.items()), out, max_shard_bytes=200)  # a group across shards
    assert len(weights.checkpoint_files(out)) > 2
    got = load_tensors(
        out, fuse=[("q", "k", "v"), ("gate", "up"), ("o", "missing")], load_format="read"
    )
    _same(got, want)
    qkv = weights.joined([got["q"], got["k"], got["v"]])
    assert qkv.data_ptr() == got["q"].data_ptr()  # the allocation itself: no copy
    assert torch.equal(qkv, torch.cat([want["q"], want["k"], want["v"]]))
    qk = weights.joined([got["q"], got["k"]])  # the first rows of it: a view as well
    assert qk.data_ptr() == got["q"].data_ptr() and torch.equal(qk, qkv[:12])
    for parts in ([got["k"], got["q"], got["v"]], [got["o"], got["o"]]):
        # out of order, or never placed together: a real concatenation
        cat = weights.joined(parts)
        assert torch.equal(cat, torch.cat(parts)) and cat.data_ptr() != parts[0].data_ptr()


def test_mapped_tensors_stored_back_to_back_are_joined_without_a_copy(tmp_path):
    """Mapped: a group the file stores adjacent and in order (a layer's gate and up, as HF
    writes them: safetensors orders a dtype's tensors by name) is one view of the file;
    q, k and v, with o between them, are concatenated."""
    g = torch.Generator().manual_seed(2)
    want = {f"attn.{n}": torch.randn(4, 6, generator=g) for n in "qkvo"}
    want |= {"mlp.gate": torch.randn(5, 6, generator=g), "mlp.up": torch.randn(5, 6, generator=g)}
    path = tmp_path / "model.safetensors"
    save_file(want, path)
    got = map_file(path)
    gate_up = weights.joined([got["mlp.gate"], got["mlp.up"]])
    assert gate_up.data_ptr() == got["mlp.gate"].data_ptr()  # the mapping itself: no copy
    assert torch.equal(gate_up, torch.cat([want["mlp.gate"], want["mlp.up"]]))
    for parts in (
        [got["attn.q"], got["attn.k"], got["attn.v"]],  # o lies between k and q
        [got["mlp.up"], got["mlp.gate"]],  # out of order
    ):
        cat = weights.joined(parts)
        assert torch.equal(cat, torch.cat(parts)) and cat.data_ptr() != parts[0].data_ptr()


@pytest.mark.parametrize("load_format", ["read", "fastsafetensors"])
def test_an_engine_loaded_another_way_generates_the_same_tokens(model_dir, prompts, load_format):
    if load_format == "fastsafetensors":
        pytest.importorskip("fastsafetensors")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    base = model_dir("tiny-llama")
    want = [o.token_ids for o in make_llm(base).generate(prompts[:3], greedy)]
    got = make_llm(base, load_format=load_format).generate(prompts[:3], greedy)
    assert [o.token_ids for o in got] == want
