"""KV blocks on the wire: raw tensor bytes plus dtype/shape in rtp.v1.KVBlock, never pickle.

A block carries K and V of every layer for up to `block_size` consecutive token positions,
each [layers, tokens, kv_heads, head_dim], exactly as the sender's cache stores them; an int8
block also carries its scales, float32 [layers, kv_heads] for K and for V. The receiver checks
shapes, dtype and that the tokens it expects are covered, and (for full blocks) the hash key,
before writing a byte.

The arrays are torch tensors, or numpy arrays for the simulated engine (which has no torch:
torch is imported only for tensors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from rtp_serve.core.dtypes import STORAGE_DTYPES
from rtp_serve.engine.config import KVLayout
from rtp_serve.engine.outputs import PromptKV
from rtp_serve.services.common.pb import common_pb2

if TYPE_CHECKING:
    import torch


# The conversions below run on the worker's serving loop, so they copy with numpy, on that
# thread alone: a torch copy this size runs a parallel region, and a second OpenMP team in
# the process (the loop's, beside the engine thread's) slows every step the engine runs
# (engine/async_llm.py).


def tensor_bytes(t: torch.Tensor | np.ndarray) -> bytes:
    """The array's elements in C order (bfloat16 as its raw bits)."""
    if not isinstance(t, np.ndarray):
        import torch

        # bfloat16 has no numpy dtype: move the raw bits as int16 (a view, any strides).
        t = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return t.tobytes()  # C order, whatever the strides


def array_from_bytes(data: bytes, dtype: str, shape: list[int]) -> np.ndarray:
    """A read-only numpy array over the wire's bytes (bfloat16 as int16 raw bits); ValueError
    on a mismatch."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype!r}")
    raw = np.frombuffer(data, dtype=np.int16 if dtype == "bfloat16" else dtype)
    expected = int(np.prod(shape, dtype=np.int64))
    if raw.size != expected:
        raise ValueError(f"KV payload has {raw.size} elements, shape {shape} needs {expected}")
    return raw.reshape(shape)


def as_tensor(a: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch tensor sharing `a`'s memory (its raw bits reinterpreted for bfloat16)."""
    import torch

    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def split_blocks(
    kv: PromptKV, block_size: int, block_hashes: list[bytes]
) -> list[common_pb2.KVBlock]:
    """Cut KV of prompt positions [start, start + n) into per-block messages.

    `kv.start` is a multiple of block_size; `block_hashes` are the prompt's full-block keys.
    """
    start, k, v = kv.start, kv.k, kv.v
    if start % block_size:
        raise ValueError(f"start {start} is not a multiple of block_size {block_size}")
    blocks = []
    for i, offset in enumerate(range(0, kv.num_tokens, block_size)):
        index = (start + offset) // block_size
        kb, vb = k[:, offset : offset + block_size], v[:, offset : offset + block_size]
        block = common_pb2.KVBlock(
            block_hash=block_hashes[index] if index < len(block_hashes) else b"",
            index=index,
            num_tokens=kb.shape[1],
            dtype=_dtype_name(k),
            shape=list(kb.shape),
            k=tensor_bytes(kb),
            v=tensor_bytes(vb),
        )
        if kv.k_scale is not None and kv.v_scale is not None:
            block.k_scale = tensor_bytes(kv.k_scale[:, i])
            block.v_scale = tensor_bytes(kv.v_scale[:, i])
        blocks.append(block)
    return blocks


def join_blocks(
    blocks: list[common_pb2.KVBlock],
    start: int,
    end: int,
    block_size: int,
    block_hashes: list[bytes],
    layout: KVLayout,
) -> PromptKV:
    """Check and concatenate blocks covering positions [start, end) into one PromptKV.

    `layout` is the receiving engine's. Raises ValueError on any mismatch.
    """
    expected_shape = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
    scale_shape = [layout.num_layers, 1, layout.num_kv_heads]
    quantized = layout.dtype == "int8"
    if layout.numpy and layout.dtype == "bfloat16":
        raise ValueError("the numpy KV of the simulated engine has no bfloat16")
    blocks = sorted(blocks, key=lambda b: b.index)
    ks, vs, k_scales, v_scales = [], [], [], []
    pos = start
    for block in blocks:
        if block.index * block_size != pos:
            raise ValueError(f"KV block {block.index} does not start at position {pos}")
        layers, tokens, heads, dim = block.shape
        if (layers, heads, dim) != expected_shape or tokens != block.num_tokens:
            raise ValueError(f"KV block {block.index} has shape {list(block.shape)}")
        if block.dtype != layout.dtype:
            raise ValueError(f"KV block {block.index} is {block.dtype}, expected {layout.dtype}")
        full = tokens == block_size
        if (
            full
            and block.index < len(block_hashes)
            and block.block_hash != block_hashes[block.index]
        ):
            raise ValueError(f"KV block {block.index} hash does not match the prompt")
        ks.append(array_from_bytes(block.k, block.dtype, list(block.shape)))
        vs.append(array_from_bytes(block.v, block.dtype, list(block.shape)))
        if quantized:  # a block without its scales fails the size check here
            k_scales.append(array_from_bytes(block.k_scale, "float32", scale_shape))
            v_scales.append(array_from_bytes(block.v_scale, "float32", scale_shape))
        pos += tokens
    if pos != end:
        raise ValueError(f"KV covers positions [{start}, {pos}), expected [{start}, {end})")
    if not ks:
        raise ValueError("no KV blocks received")
    # Joined in numpy (one copy, on this thread alone); a tensor shares the result's memory.
    if layout.numpy:
        arrays = [np.concatenate(parts, 1) for parts in (ks, vs, k_scales, v_scales) if parts]
    else:
        dtypes = (layout.dtype, layout.dtype, "float32", "float32")
        arrays = [
            as_tensor(np.concatenate(parts, 1), dtype)
            for parts, dtype in zip((ks, vs, k_scales, v_scales), dtypes, strict=True)
            if parts
        ]
    return PromptKV(start, *arrays)


def _dtype_name(t: torch.Tensor | np.ndarray) -> str:
    if isinstance(t, np.ndarray):
        return t.dtype.name
    from rtp_serve.engine.dtypes import dtype_name

    return dtype_name(t.dtype)
