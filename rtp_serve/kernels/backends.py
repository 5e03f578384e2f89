"""Which attention backend a worker runs, chosen by what is installed and what it supports.

    device  order tried                           each needs
    cuda    flash-attn                             flash_attn importable; fp16/bf16 model and
                                                   cache; blocks a multiple of 256 tokens
            flashinfer                             flashinfer importable; fp16/bf16 model
                                                   and cache (any block size)
            triton                                 triton importable (kernels/triton)
            torch                                  nothing (the reference ops)
    cpu     cpu-kernels                            the compiled kernels build (rtp_serve/kernels/cpu.py)
            torch

The first that fits is used; the choice, and why each one before it was passed over, is
logged at start and reported in the worker's Stats (`attention_backend`). Triton is not
used on CPU: its interpreter is for tests, many times slower than the compiled kernels.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rtp_serve.kernels.attention import AttentionBackend, CpuKernelAttention, TorchAttention

FLASH_ATTN_PAGE = 256  # flash-attn's paged KV takes pages of a multiple of this many tokens


@dataclass(frozen=True, slots=True)
class BackendChoice:
    name: str  # flash-attn | flashinfer | triton | cpu-kernels | torch
    passed_over: tuple[str, ...] = ()  # "name: why" for each tried before it

    def describe(self) -> str:
        skipped = "; ".join(self.passed_over)
        return self.name + (f" (passed over {skipped})" if skipped else "")


def importable(module: str) -> bool:
    """Whether `module` would import (a module hidden as None in sys.modules would not)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def choose(
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    block_size: int,
    have: Callable[[str], bool] = importable,
) -> BackendChoice:
    if device.type != "cuda":
        from rtp_serve.kernels import cpu

        if cpu.load() is not None:
            return BackendChoice("cpu-kernels")
        return BackendChoice("torch", ("cpu-kernels: not built (ISA level or no compiler)",))
    passed: list[str] = []
    half = (torch.float16, torch.bfloat16)
    if not have("flash_attn"):
        passed.append("flash-attn: not installed")
    elif dtype not in half or kv_dtype != dtype:
        passed.append(f"flash-attn: needs an fp16/bf16 model and cache, not {dtype}/{kv_dtype}")
    elif block_size % FLASH_ATTN_PAGE:
        passed.append(f"flash-attn: block size {block_size} is not a multiple of 256")
    else:
        return BackendChoice("flash-attn", tuple(passed))
    if not have("flashinfer"):
        passed.append("flashinfer: not installed")
    elif dtype not in half or kv_dtype != dtype:
        passed.append(f"flashinfer: needs an fp16/bf16 model and cache, not {dtype}/{kv_dtype}")
    else:
        return BackendChoice("flashinfer", tuple(passed))
    if have("triton"):
        return BackendChoice("triton", tuple(passed))
    passed.append("triton: not installed")
    return BackendChoice("torch", tuple(passed))


def build(choice: BackendChoice, scale: float, device: torch.device) -> AttentionBackend:
    if choice.name == "flash-attn":
        from rtp_serve.kernels.flash_attn import FlashAttention

        return FlashAttention(scale)
    if choice.name == "flashinfer":
        from rtp_serve.kernels.flashinfer import FlashInferAttention

        return FlashInferAttention(scale, device)
    if choice.name == "triton":
        from rtp_serve.kernels.triton.backend import TritonAttention

        return TritonAttention(scale)
    if choice.name == "cpu-kernels":
        from rtp_serve.kernels import cpu
        from rtp_serve.kernels.isa import cpu_isa

        # Prefill on the kernel where it was measured faster (CpuKernelAttention's docstring).
        return CpuKernelAttention(scale, cpu.load(), compiled_prefill=cpu_isa().at_least("avx512"))
    return TorchAttention(scale)
