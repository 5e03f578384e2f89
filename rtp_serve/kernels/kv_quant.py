"""The INT8 KV cache: one float32 scale per block and kv head, adapting to the block's range.

A block's rows of one kv head are `int8 * scale[block, head]`. The scale is the largest
|value| seen in that block and head so far, over 127 (RTP-LLM's adaptive KV-cache
quantization: a block of small values keeps fine steps, one of large values does not clip).
Rows are written in position order, so a block fills up over steps:

    step n:   block 7 gets offsets 0..9    scale reset (offset 0 starts a fresh block),
                                           set from the rows' max
    step n+1: block 7 gets offset 10       max |row| > scale * 127? the scale grows, and
                                           rows 0..9 are requantized to it: round(q * old/new)

A block whose offset-0 row is written forgets the scale of its previous owner. Blocks that
move between workers or tiers carry their scales with them (engine.outputs.PromptKV), so a
copy reads exactly as the original.

`write_int8` here is the torch reference and fallback; the compiled kernel
(kernels/csrc/kv_quant.cpp) does the same per (run of tokens in one block, kv head).
"""

from __future__ import annotations

import torch

QMAX = 127.0


def write_int8(
    cache: torch.Tensor,
    scales: torch.Tensor,
    x: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    """Quantize rows x [T, H, D] into the int8 cache [S, H, D] at their slots, adapting the
    scales [blocks, H] of every block they touch.

    The tokens of one block must be contiguous in `slot_mapping` and in position order, as a
    step lays out each request's new tokens.
    """
    t = x.shape[0]
    if t == 0:
        return
    blocks = slot_mapping // block_size
    # Runs of consecutive tokens in one block: the unit a scale is decided for.
    first = torch.ones(t, dtype=torch.bool, device=x.device)
    first[1:] = blocks[1:] != blocks[:-1]
    run_of = first.cumsum(0) - 1  # [T] run of each token
    starts = first.nonzero().squeeze(1)
    run_block = blocks[starts]
    continues = (slot_mapping[starts] % block_size) > 0  # earlier rows of the block are valid
    heads = x.shape[1]
    amax = torch.zeros(len(starts), heads, dtype=torch.float32, device=x.device)
    amax.scatter_reduce_(0, run_of[:, None].expand(-1, heads), x.abs().amax(-1).float(), "amax")
    old = torch.where(continues[:, None], scales[run_block], 0.0)  # never a stale NaN
    new = torch.maximum(old, amax * (1.0 / QMAX))  # as the compiled kernel rounds
    grown = (old > 0) & (new > old)
    if bool(grown.any()):
        runs = grown.any(1).nonzero().squeeze(1)
        rows = (
            run_block[runs, None] * block_size + torch.arange(block_size, device=x.device)
        ).flatten()
        ratio = torch.where(grown[runs], old[runs] / new[runs], 1.0)  # [R, H]
        held = cache[rows].view(len(runs), block_size, heads, -1).float()
        requant = (held * ratio[:, None, :, None]).round().clamp_(-QMAX, QMAX)
        cache[rows] = requant.to(torch.int8).view(-1, heads, cache.shape[-1])
    scales[run_block] = new
    inv = torch.where(new > 0, 1.0 / new, 0.0)[run_of]  # [T, H]
    cache[slot_mapping] = (x.float() * inv[..., None]).round().clamp_(-QMAX, QMAX).to(torch.int8)


def dequantize(rows: torch.Tensor, row_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., H, D] times their scales [..., H], in `dtype`."""
    return (rows.float() * row_scales[..., None]).to(dtype)
