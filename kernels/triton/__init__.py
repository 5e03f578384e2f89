"""Triton kernels over the paged KV cache (rtp_serve/kernels/attention.py has the layout).

One kernel per file, each with the torch reference as its test oracle:

    paged_decode.py    one query token per sequence over its cached context; GQA heads of
                       a kv head share each K/V load; split-K over long contexts
    paged_prefill.py   a varlen batch of chunks after a cached prefix, causal within the
                       new tokens, K/V read through each chunk's block table
    kv_write.py        new K/V rows into their slots (slot mapping); the int8 cache's
                       adaptive per-block scales (rtp_serve/kernels/kv_quant.py) decided in-kernel
    rms_norm.py        RMSNorm, optionally fused with the residual add before it
    rotary.py          rotary embedding (rotate-half layout), HF's rounding in bf16

An int8 cache is dequantized as it is read (int8 * scale[block, kv head]). Any block size
works: every key's slot is looked up from its block table, none is assumed a power of two.

They run on CUDA, and on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`, set
before triton is imported), which is how CI tests them. The kernel modules import triton;
this one does not, so `available()` can say whether it is there.
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """Whether triton is importable (the kernels may then run, on CUDA or interpreted)."""
    return importlib.util.find_spec("triton") is not None
