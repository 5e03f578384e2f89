"""Which attention backend is chosen: in order, by what imports and what each supports."""

from __future__ import annotations

import sys

import pytest
import torch

from rtp_serve.kernels import backends
from rtp_serve.kernels.attention import (
    AttentionMetadata,
    PrefillChunk,
    StepSequences,
    TorchAttention,
)

CUDA = torch.device("cuda")
BF16, FP32, INT8 = torch.bfloat16, torch.float32, torch.int8
EVERYTHING = {"flash_attn", "flashinfer", "triton"}.__contains__


def test_cuda_prefers_flash_attn_where_it_fits():
    assert backends.choose(CUDA, BF16, BF16, 256, EVERYTHING) == backends.BackendChoice(
        "flash-attn"
    )


@pytest.mark.parametrize(
    "dtype,kv_dtype,block_size,chosen,passed_over",
    [
        (BF16, BF16, 16, "flashinfer", ["flash-attn: block size 16 is not a multiple of 256"]),
        (FP32, FP32, 256, "triton", ["flash-attn: needs an fp16/bf16", "flashinfer: needs"]),
        (BF16, INT8, 256, "triton", ["flash-attn: needs an fp16/bf16", "flashinfer: needs"]),
    ],
)
def test_cuda_falls_back_where_a_backend_does_not_fit(
    dtype, kv_dtype, block_size, chosen, passed_over
):
    choice = backends.choose(CUDA, dtype, kv_dtype, block_size, EVERYTHING)
    assert choice.name == chosen
    assert len(choice.passed_over) == len(passed_over)
    for why, expected in zip(choice.passed_over, passed_over, strict=True):
        assert why.startswith(expected), why


def test_cuda_falls_back_in_order_as_backends_go_missing():
    missing = ("flash-attn: not installed", "flashinfer: not installed")
    no_flash_attn = backends.choose(CUDA, BF16, BF16, 256, {"flashinfer", "triton"}.__contains__)
    assert no_flash_attn == backends.BackendChoice("flashinfer", missing[:1])
    only_triton = backends.choose(CUDA, BF16, BF16, 256, {"triton"}.__contains__)
    assert only_triton == backends.BackendChoice("triton", missing)
    nothing = backends.choose(CUDA, BF16, BF16, 256, set().__contains__)
    assert nothing == backends.BackendChoice("torch", (*missing, "triton: not installed"))
    assert nothing.describe().startswith("torch (passed over flash-attn: not installed; ")


def test_a_hidden_module_is_not_importable(monkeypatch):
    """The default check, with triton (installed by the dev extra) hidden from import."""
    assert backends.importable("triton")
    assert backends.choose(CUDA, FP32, FP32, 16).name == "triton"
    monkeypatch.setitem(sys.modules, "triton", None)
    assert not backends.importable("triton")
    assert backends.choose(CUDA, FP32, FP32, 16).name == "torch"


def test_cpu_uses_the_compiled_kernels_or_the_reference(monkeypatch):
    monkeypatch.setenv("RTP_SERVE_ISA", "scalar")
    choice = backends.choose(torch.device("cpu"), FP32, FP32, 16)
    assert choice.name == "torch" and choice.passed_over[0].startswith("cpu-kernels")
    assert type(backends.build(choice, 0.125, torch.device("cpu"))) is TorchAttention


def test_build_makes_the_chosen_backend():
    from rtp_serve.kernels.triton.backend import TritonAttention

    triton = backends.build(backends.BackendChoice("triton"), 0.125, CUDA)
    assert type(triton) is TritonAttention


def test_step_sequences_for_the_library_backends():
    """Decode rows and chunks as sequences: query and key counts, offsets, padded tables."""
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(9, dtype=torch.int64),
        block_size=4,
        num_decodes=2,
        decode_block_tables=torch.tensor([[3, 0], [5, 6]]),
        decode_seq_lens=torch.tensor([2, 7]),
        prefills=[PrefillChunk(2, 7, 5, torch.tensor([1, 2, 4]))],
    )
    seqs = StepSequences.of(meta, torch.device("cpu"))
    assert seqs.q_lens.tolist() == [1, 1, 7]
    assert seqs.q_indptr.tolist() == [0, 1, 2, 9]
    assert seqs.k_lens.tolist() == [2, 7, 12]
    assert seqs.block_tables.tolist() == [[3, 0, 0], [5, 6, 0], [1, 2, 4]]
    assert seqs.block_tables.dtype == torch.int32


def _mixed_meta(device: torch.device, block_size: int = 4) -> AttentionMetadata:
    """Two decodes (2 and 7 keys) and a chunk of 7 after 5 cached, in blocks of 4."""
    return AttentionMetadata(
        slot_mapping=torch.zeros(9, dtype=torch.int64, device=device),
        block_size=block_size,
        num_decodes=2,
        decode_block_tables=torch.tensor([[3, 0], [5, 6]], device=device),
        decode_seq_lens=torch.tensor([2, 7], device=device),
        prefills=[PrefillChunk(2, 7, 5, torch.tensor([1, 2, 4], device=device))],
    )


def test_flash_attn_tables_of_a_step():
    """What flash_attn_varlen_func is given, built in plain torch (so on CPU here)."""
    from rtp_serve.kernels.flash_attn import FlashTables

    t = FlashTables.of(_mixed_meta(torch.device("cpu")), torch.device("cpu"))
    assert t.cu_seqlens_q.tolist() == [0, 1, 2, 9]
    assert t.cu_seqlens_k.tolist() == [0, 2, 9, 21]
    assert (t.max_seqlen_q, t.max_seqlen_k) == (7, 12)
    assert type(t.max_seqlen_q) is int and type(t.max_seqlen_k) is int
    assert t.block_table.tolist() == [[3, 0, 0], [5, 6, 0], [1, 2, 4]]
    assert t.cu_seqlens_k.dtype == t.block_table.dtype == torch.int32


def test_flash_attn_builds_a_steps_tables_once_for_all_layers():
    from rtp_serve.kernels.flash_attn import StepTables

    tables, cpu = StepTables(), torch.device("cpu")
    step = _mixed_meta(cpu)
    first = tables.get(step, cpu)
    assert all(tables.get(step, cpu) is first for _ in range(3))  # layers 2..4
    nxt = _mixed_meta(cpu)  # the next step: equal contents, a new metadata
    assert tables.get(nxt, cpu) is not first


def _library_step(device: torch.device, block_size: int):
    """A mixed bf16 step over a cache of 8 blocks: q, k, v, two copies of the cache, meta."""
    from rtp_serve.kernels.attention import LayerCache

    torch.manual_seed(11)
    hq, hkv, d, bs = 4, 2, 64, block_size
    seqs = [(6, 1), (12, 1), (5, 7), (0, 9)]  # (cached, new); decodes first
    tables = [[7 - i] for i in range(len(seqs))]  # blocks of 16 or more: one each

    def slots(table, start, end):
        return torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)])

    k_all = torch.randn(8 * bs, hkv, d, dtype=torch.bfloat16, device=device)
    v_all = torch.randn_like(k_all)
    caches = [LayerCache(k_all.clone(), v_all.clone()) for _ in range(2)]
    total = sum(n for _, n in seqs)
    q, k, v = (torch.randn(total, h, d, device=device, dtype=torch.bfloat16)
               for h in (hq, hkv, hkv))  # fmt: skip
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.cat(
            [slots(t, c, c + n) for (c, n), t in zip(seqs, tables, strict=True)]
        ).to(device),
        block_size=bs,
        num_decodes=2,
        decode_block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables[:2]], device=device
        ),  # fmt: skip
        decode_seq_lens=torch.tensor([7, 13], device=device),
        prefills=[
            PrefillChunk(2, 7, 5, torch.tensor(tables[2], device=device)),
            PrefillChunk(9, 9, 0, torch.tensor(tables[3], device=device)),
        ],
    )
    return q, k, v, caches, meta, d**-0.5


@pytest.mark.parametrize("name,package,block_size", [
    ("flash-attn", "flash_attn", backends.FLASH_ATTN_PAGE),
    ("flashinfer", "flashinfer", 16),
])  # fmt: skip
def test_library_backend_matches_the_reference_on_a_mixed_step(name, package, block_size):
    """Each library wrapper, built as a worker builds it, over two layers of one step (the
    second reuses the step's tables/plan) against the torch reference in bf16."""
    if not backends.importable(package):
        pytest.skip(f"{package} is not installed (a GPU package: the `gpu` extra)")
    if not torch.cuda.is_available():
        pytest.skip(f"{package} runs on CUDA only, and there is no CUDA device here")
    device = torch.device("cuda")
    q, k, v, caches, meta, scale = _library_step(device, block_size)
    backend = backends.build(backends.BackendChoice(name), scale, device)
    reference = TorchAttention(scale)
    for _layer in range(2):
        expected = reference.forward(q, k, v, caches[0], meta)
        got = backend.forward(q, k, v, caches[1], meta)
        assert torch.equal(caches[1].k, caches[0].k) and torch.equal(caches[1].v, caches[0].v)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
