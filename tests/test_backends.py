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
