"""Which attention backend is chosen: in order, by what imports and what each supports."""

from __future__ import annotations

import sys

import pytest
import torch

from kernels import backends
from kernels.attention import TorchAttention

CUDA = torch.device("cuda")
BF16, FP32, INT8 = torch.bfloat16, torch.float32, torch.int8


def test_cuda_prefers_flash_attn_where_it_fits():
    both = {"flash_attn", "triton"}.__contains__
    assert backends.choose(CUDA, BF16, BF16, 256, both) == backends.BackendChoice("flash-attn")


@pytest.mark.parametrize(
    "dtype,kv_dtype,block_size,why",
    [
        (BF16, BF16, 16, "flash-attn: block size 16 is not a multiple of 256"),
        (FP32, FP32, 256, "flash-attn: needs an fp16/bf16 model and cache"),
        (BF16, INT8, 256, "flash-attn: needs an fp16/bf16 model and cache"),
    ],
)
def test_cuda_falls_back_to_triton_where_flash_attn_does_not_fit(dtype, kv_dtype, block_size, why):
    choice = backends.choose(
        CUDA, dtype, kv_dtype, block_size, {"flash_attn", "triton"}.__contains__
    )
    assert choice.name == "triton"
    assert len(choice.passed_over) == 1 and choice.passed_over[0].startswith(why)


def test_cuda_falls_back_in_order_as_backends_go_missing():
    only_triton = backends.choose(CUDA, BF16, BF16, 256, {"triton"}.__contains__)
    assert only_triton == backends.BackendChoice("triton", ("flash-attn: not installed",))
    nothing = backends.choose(CUDA, BF16, BF16, 256, set().__contains__)
    assert nothing == backends.BackendChoice(
        "torch", ("flash-attn: not installed", "triton: not installed")
    )
    assert "passed over flash-attn: not installed" in nothing.describe()


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
    assert type(backends.build(choice, 0.125)) is TorchAttention


def test_build_makes_the_chosen_backend():
    from kernels.triton.backend import TritonAttention

    assert type(backends.build(backends.BackendChoice("triton"), 0.125)) is TritonAttention
