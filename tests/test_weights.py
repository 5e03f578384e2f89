"""The checkpoint loader (engine/weights.py), mapped and read, gives exactly what
safetensors' own loader gives: same names, dtypes, shapes and bits, for one file and for
shards, in float32, bfloat16 and the integer and float8 dtypes; and refuses broken files
clearly. Mapped tensors are views of the file, and writing one never reaches the file."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import weights
from engine.checkpoint_writer import save_weights
from engine.weights import load_tensors, map_file, read_file


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
    _same(load_tensors(tmp_path, mapped=False), load_file(path))


def test_mapped_tensors_are_views_of_the_file_that_writes_never_reach(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(1024, 64), "b": torch.zeros(3)}, path)
    before = path.read_bytes()
    got = map_file(path)
    assert got["a"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()
    got["a"].mul_(3.0)  # copy-on-write: this process's pages only
    assert torch.equal(got["a"], torch.full((1024, 64), 3.0))
    assert path.read_bytes() == before
    assert torch.equal(map_file(path)["a"], torch.ones(1024, 64))


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_in_shards_reads_bit_identical(model_dir, tmp_path, dtype, mapped):
    base = model_dir("tiny-llama")
    want = {k: v.to(dtype) for k, v in load_file(base / "model.safetensors").items()}
    out = tmp_path / "sharded"
    out.mkdir()
    save_weights(sorted(want.items()), out, max_shard_bytes=256 << 10)
    shards = weights.checkpoint_files(out)
    assert len(shards) > 3  # really sharded: read in parallel where there are cores
    _same(load_tensors(out, mapped=mapped), want)


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
    got = load_tensors(out, fuse=[("q", "k", "v"), ("gate", "up"), ("o", "missing")], mapped=False)
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
