"""The Triton kernels against the torch reference ops, on CUDA where there is one, else in
Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1): small
shapes, since interpreting is slow.

Tolerances: float32 queries 2e-5 (the kernels accumulate in float32 in another order than
SDPA); bf16 2e-2 (one bf16 rounding of the output, and a bf16 probability in the
reference). The int8 writes and bf16 rotary embedding are compared exactly.
"""

from __future__ import annotations

import pytest
import torch

from rtp_serve.engine.models.llama import apply_rope
from rtp_serve.engine.models.llama import rms_norm as ref_rms_norm
from rtp_serve.kernels import kv_quant
from rtp_serve.kernels.attention import AttentionMetadata, LayerCache, paged_decode, paged_prefill
from tests.test_attention_kernels import empty_cache, padded, scatter_cache, slots_of

pytest.importorskip("triton")
from rtp_serve.kernels.triton import (  # noqa: E402
    kv_write,
    rotary,  # noqa: E402
)
from rtp_serve.kernels.triton import paged_decode as tri_decode
from rtp_serve.kernels.triton import paged_prefill as tri_prefill  # noqa: E402
from rtp_serve.kernels.triton import rms_norm as tri_norm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def on_device(cache: LayerCache) -> LayerCache:
    return LayerCache(*(None if t is None else t.to(DEVICE) for t in (
        cache.k, cache.v, cache.k_scale, cache.v_scale)))  # fmt: skip


@pytest.mark.parametrize(
    "dtype,heads,block_size",
    [
        # GQA ratios 1, 3, 4; block size 5 (no power of two: blocks straddle key tiles)
        (torch.float32, (2, 2), 5),
        (torch.float32, (6, 2), 5),
        (torch.float32, (4, 1), 16),
        (torch.bfloat16, (2, 2), 16),
        (torch.bfloat16, (6, 2), 5),
        (torch.bfloat16, (4, 1), 5),
    ],
)
def test_paged_decode_matches_reference(dtype, heads, block_size):
    torch.manual_seed(0)
    hq, hkv, d = *heads, 16
    lens = [1, 4, block_size, 37]  # ragged, at and across block boundaries
    contexts = [(torch.randn(n, hkv, d), torch.randn(n, hkv, d)) for n in lens]
    cache, tables = scatter_cache(contexts, 24, block_size, dtype)
    cache = on_device(cache)
    q = torch.randn(len(lens), hq, d).to(dtype).to(DEVICE)
    tables_t, lens_t = padded(tables).to(DEVICE), torch.tensor(lens, device=DEVICE)
    expected = paged_decode(q, cache.k, cache.v, tables_t, lens_t, block_size, d**-0.5)
    got = tri_decode.paged_decode(
        q, cache.k, cache.v, tables_t, lens_t, block_size, d**-0.5, splits=2
    )
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_paged_decode_split_k_over_long_contexts(splits, kv_dtype):
    """Split-K: contexts of many tiles cut into ranges, including ranges that are empty
    (a short sequence beside a long one) and an int8 cache dequantized as it is read."""
    torch.manual_seed(1)
    hq, hkv, d, bs = 4, 2, 16, 16
    lens = [300, 3, 129]
    contexts = [(torch.randn(n, hkv, d), torch.randn(n, hkv, d)) for n in lens]
    cache, tables = scatter_cache(contexts, 40, bs, kv_dtype)
    cache = on_device(cache)
    q = torch.randn(len(lens), hq, d, device=DEVICE)
    args = (padded(tables).to(DEVICE), torch.tensor(lens, device=DEVICE), bs, d**-0.5)
    scales = (cache.k_scale, cache.v_scale)
    expected = paged_decode(q, cache.k, cache.v, *args, *scales)
    got = tri_decode.paged_decode(q, cache.k, cache.v, *args, *scales, splits=splits)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_num_splits_fills_small_batches_only():
    assert tri_decode.num_splits(1, 8) == tri_decode.MAX_SPLITS
    assert tri_decode.num_splits(4, 8) == 8
    assert tri_decode.num_splits(128, 8) == 1


def _prefill_case(chunks, hq, hkv, d, bs, kv_dtype, q_dtype):
    """chunks [(ctx_len, q_len)]: each sequence's prefix and new K/V written to a cache."""
    contexts = [(torch.randn(c + n, hkv, d), torch.randn(c + n, hkv, d)) for c, n in chunks]
    cache, tables = scatter_cache(contexts, 40, bs, kv_dtype)
    q = torch.randn(sum(n for _, n in chunks), hq, d).to(q_dtype)
    return on_device(cache), tables, q.to(DEVICE)


@pytest.mark.parametrize(
    "kv_dtype,q_dtype,heads",
    [
        (torch.float32, torch.float32, (2, 2)),
        (torch.float32, torch.float32, (6, 2)),
        (torch.float32, torch.float32, (4, 1)),
        (torch.bfloat16, torch.bfloat16, (6, 2)),
        (torch.bfloat16, torch.float32, (4, 1)),  # a narrower cache under float32
        (torch.int8, torch.float32, (6, 2)),
        (torch.int8, torch.bfloat16, (4, 1)),
    ],
)
def test_paged_prefill_varlen_matches_reference(kv_dtype, q_dtype, heads):
    """One launch over a ragged batch: a fresh prompt, chunks after a cached prefix ending
    mid-block and on a boundary, one of several query tiles, a single new token."""
    torch.manual_seed(2)
    hq, hkv, d, bs = *heads, 16, 5
    chunks = [(0, 7), (13, 5), (10, 20), (3, 1)]
    cache, tables, q = _prefill_case(chunks, hq, hkv, d, bs, kv_dtype, q_dtype)
    starts, offset = [], 0
    for _, n in chunks:
        starts.append(offset)
        offset += n
    expected = torch.cat(
        [
            paged_prefill(q[s : s + n], cache, torch.tensor(t, device=DEVICE), c, bs, d**-0.5)
            for s, (c, n), t in zip(starts, chunks, tables, strict=True)
        ]
    )
    got = torch.full_like(q, float("nan"))
    ints = {"device": DEVICE, "dtype": torch.int32}
    tri_prefill.paged_prefill_varlen(
        q, got, cache.k, cache.v, padded(tables).to(DEVICE),
        torch.tensor(starts, **ints), torch.tensor([n for _, n in chunks], **ints),
        torch.tensor([c for c, _ in chunks], **ints), max(n for _, n in chunks),
        bs, d**-0.5, cache.k_scale, cache.v_scale,
    )  # fmt: skip
    tol = TOL[q_dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_copies_rows_to_their_slots(dtype):
    torch.manual_seed(3)
    cache = torch.zeros(40, 3, 16, dtype=dtype, device=DEVICE)
    x = torch.randn(6, 3, 16, device=DEVICE)  # float32 rows into a narrower cache
    slots = torch.tensor([17, 3, 4, 39, 0, 21], device=DEVICE)
    expected = cache.clone()
    expected.index_copy_(0, slots, x.to(dtype))
    kv_write.write_kv(cache, x, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("block_size", [4, 5])
def test_write_int8_matches_reference_over_steps(block_size):
    """Scripted steps over the same blocks: a prompt filling blocks from offset 0, then
    decodes that continue a block with larger values (the scale grows and the block is
    requantized) and smaller ones (it does not), in a batch of ragged runs; int8 rows and
    scales equal the reference's exactly."""
    torch.manual_seed(4)
    hkv, d = 2, 16
    ref = empty_cache(12, block_size, hkv, d, torch.int8)
    ref = LayerCache(ref.k, ref.v, ref.k_scale.nan_to_num(7.0), ref.v_scale)
    tri = on_device(LayerCache(ref.k.clone(), ref.v, ref.k_scale.clone(), ref.v_scale))
    table_a, table_b = [3, 7, 1], [10, 0]
    steps = [
        # (rows of sequence a, rows of sequence b) as (start, end, magnitude)
        [("a", 0, 6, 1.0), ("b", 0, 3, 0.5)],
        [("a", 6, 7, 4.0), ("b", 3, 4, 0.1)],
        [("a", 7, 9, 0.2), ("b", 4, 7, 9.0)],
    ]
    for step in steps:
        slots, rows = [], []
        for name, start, end, mag in step:
            table = table_a if name == "a" else table_b
            slots.append(slots_of(table, start, end, block_size))
            rows.append(torch.randn(end - start, hkv, d) * mag)
        slot_mapping, x = torch.cat(slots), torch.cat(rows)
        kv_quant.write_int8(ref.k, ref.k_scale, x, slot_mapping, block_size)
        kv_write.write_int8(tri.k, tri.k_scale, x.to(DEVICE), slot_mapping.to(DEVICE), block_size)
        held = torch.tensor(sorted({b for t in (table_a, table_b) for b in t}))
        rows_of = (held[:, None] * block_size + torch.arange(block_size)).flatten()
        assert torch.equal(tri.k_scale.cpu()[held], ref.k_scale[held])
        assert torch.equal(tri.k.cpu()[rows_of], ref.k[rows_of])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_reference(dtype, residual):
    torch.manual_seed(5)
    x = torch.randn(5, 48, device=DEVICE).to(dtype)  # 48: not a power of two
    w = (torch.rand(48, device=DEVICE) + 0.5).to(dtype)
    r = torch.randn(5, 48, device=DEVICE).to(dtype)
    if residual:
        out, r_out = tri_norm.rms_norm(x, w, 1e-6, residual=r)
        summed = x + r
        assert torch.equal(r_out, summed)
        expected = ref_rms_norm(summed, w, 1e-6)
    else:
        out = tri_norm.rms_norm(x, w, 1e-6)
        expected = ref_rms_norm(x, w, 1e-6)
    # bf16: one rounding step of the output apart at most (rsqrt differs in its last bits)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_reference(dtype):
    """On a strided view (q and k heads of the fused qkv output), as the model calls it."""
    from rtp_serve.core.model_config import RopeScaling
    from rtp_serve.engine.models.llama import rope_inv_freq

    torch.manual_seed(6)
    t, heads, d = 7, 5, 16
    inv = rope_inv_freq(d, 10000.0, RopeScaling())
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], -1)
    positions = torch.tensor([0, 1, 2, 30, 31, 63, 5])
    cos = emb.cos().to(dtype)[positions].unsqueeze(1).to(DEVICE)
    sin = emb.sin().to(dtype)[positions].unsqueeze(1).to(DEVICE)
    qkv = torch.randn(t, (heads + 2) * d, device=DEVICE).to(dtype)
    x = qkv[:, : heads * d].view(t, heads, d)
    expected = apply_rope(x, cos, sin)
    got = rotary.apply_rope(x, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)  # each product and sum rounded as torch rounds
    else:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_triton_backend_mixed_step_matches_reference_backend(kv_dtype):
    """A whole step through TritonAttention.forward (decodes, a chunk after cached context,
    a fresh prompt): the same cache contents and outputs as the reference backend's."""
    from rtp_serve.kernels.attention import (
        AttentionMetadata,
        PrefillChunk,
        TorchAttention,
        write_kv,
    )
    from rtp_serve.kernels.triton.backend import TritonAttention

    torch.manual_seed(7)
    hq, hkv, d, bs = 4, 2, 16, 4
    seqs = [(6, 1), (12, 1), (5, 7), (0, 9)]  # (cached, new) per sequence, decodes first
    template = empty_cache(32, bs, hkv, d, kv_dtype)
    template = LayerCache(template.k, template.v, *(
        None if s is None else s.nan_to_num(0.0) for s in (template.k_scale, template.v_scale)))  # fmt: skip
    free = torch.randperm(32).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // bs))] for c, n in seqs]
    for (c, _), table in zip(seqs, tables, strict=True):
        if c:
            slots = slots_of(table, 0, c, bs)
            write_kv(template, torch.randn(c, hkv, d), torch.randn(c, hkv, d), slots, bs)
    total = sum(n for _, n in seqs)
    q, k, v = (torch.randn(total, h, d, device=DEVICE) for h in (hq, hkv, hkv))
    meta = AttentionMetadata(
        slot_mapping=torch.cat(
            [slots_of(t, c, c + n, bs) for (c, n), t in zip(seqs, tables, strict=True)]
        ).to(DEVICE),
        block_size=bs,
        num_decodes=2,
        decode_block_tables=padded(tables[:2]).to(DEVICE),
        decode_seq_lens=torch.tensor([7, 13], device=DEVICE),
        prefills=[
            PrefillChunk(2, 7, 5, torch.tensor(tables[2], device=DEVICE)),
            PrefillChunk(9, 9, 0, torch.tensor(tables[3], device=DEVICE)),
        ],
    )
    caches = [on_device(LayerCache(*(None if t is None else t.clone() for t in (
        template.k, template.v, template.k_scale, template.v_scale)))) for _ in range(2)]  # fmt: skip
    expected = TorchAttention(d**-0.5).forward(q, k, v, caches[0], meta)
    got = TritonAttention(d**-0.5).forward(q, k, v, caches[1], meta)
    assert torch.equal(caches[1].k, caches[0].k) and torch.equal(caches[1].v, caches[0].v)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.slow  # a few hundred interpreted launches: ~1 min on 2 cores
def test_engine_on_the_triton_kernels_matches_hf(model_dir, hf_greedy, prompts):
    """The model on the kernels a CUDA worker chooses (Triton attention, RMSNorm, rotary),
    swapped in on CPU: HF's greedy tokens, through a chunked prefill beside decodes."""
    preset = "tiny-qwen2"  # GQA and a qkv bias
    from rtp_serve.engine import SamplingParams
    from rtp_serve.kernels.triton.backend import TritonAttention
    from tests import helpers

    # On the test device: compiled Triton on a CUDA host must get device pointers. Graphs
    # off, so every step runs the modules swapped in below.
    llm = helpers.make_llm(
        model_dir(preset), "float32", max_num_batched_tokens=16, device=str(DEVICE),
        cuda_graph_sizes=(),
    )  # fmt: skip
    assert llm.engine.runner.device.type == DEVICE.type
    model = llm.engine.runner.model
    model.attention = TritonAttention(model.attention.scale)
    model.norm, model.rope = tri_norm.rms_norm, rotary.apply_rope
    chosen = [prompts[0], prompts[3]]  # 5 and 24 tokens: the second in two chunks
    outs = llm.generate(chosen, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(chosen, outs, strict=True):
        assert out.token_ids == hf_greedy(preset, prompt)[0][:5], f"prompt of {len(prompt)}"


def test_write_int8_under_graph_padding_stays_in_its_slots():
    """A decode step through DecodeGraphs with INT8 KV: 3 live rows padded to 16, so 13
    padding rows (over three blocks' worth) all write the scratch slot, as do all 16 while
    capturing. The Triton kernel must write each token to its own slot: the whole cache
    (scratch block included) and its scales equal the reference's, and the guard regions
    after the last layer's V and after the scales are untouched."""
    from rtp_serve.engine.cuda_graphs import DecodeGraphs

    torch.manual_seed(6)
    layers, hkv, d, bs, live_blocks, guard = 2, 2, 16, 4, 6, 64
    scratch = live_blocks  # one block past the pool's, as ModelRunner lays it out
    slots = (live_blocks + 1) * bs
    shape, scale_shape = (layers, 2, slots, hkv, d), (layers, 2, live_blocks + 1, hkv)

    def guarded(n: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.int8:
            return torch.randint(-100, 100, (n + guard,), dtype=dtype)
        return torch.rand(n + guard, dtype=dtype) + 0.1

    kv_flat = guarded(torch.Size(shape).numel(), torch.int8).to(DEVICE)
    sc_flat = guarded(torch.Size(scale_shape).numel(), torch.float32).to(DEVICE)
    kv, scales = kv_flat[:-guard].view(shape), sc_flat[:-guard].view(scale_shape)
    ref_kv, ref_scales = kv.cpu().clone(), scales.cpu().clone()
    kv_guard, sc_guard = kv_flat[-guard:].clone(), sc_flat[-guard:].clone()
    embed = torch.randn(32, layers, 2, hkv, d)  # token id -> its K/V rows per layer

    def write_all(cache, scale, ids, slot_mapping, write):
        x = embed[ids.cpu()].to(cache.device)
        for layer in range(layers):
            for kv_i in range(2):
                write(cache[layer, kv_i], scale[layer, kv_i], x[:, layer, kv_i], slot_mapping, bs)

    def forward(ids, positions, meta, rows):
        write_all(kv, scales, ids, meta.slot_mapping, kv_write.write_int8)
        return torch.zeros(ids.shape[0], 1, device=ids.device)

    def capture(fn):
        fn(), fn()  # as cuda_capture runs it: a warm-up, then the captured run
        return fn

    graphs = DecodeGraphs(forward, (4, 16), 3, scratch, bs, DEVICE, capture)
    # What capturing wrote: every row padding, all at the scratch slot.
    pad = graphs.buffers.meta(16, bs).slot_mapping.cpu()
    for _ in range(2 * len(graphs.sizes)):
        write_all(ref_kv, ref_scales, torch.zeros(16, dtype=torch.int64), pad, kv_quant.write_int8)
    assert torch.equal(kv_flat[-guard:], kv_guard), "wrote past the end of the cache"
    assert torch.equal(kv.cpu(), ref_kv) and torch.equal(scales.cpu(), ref_scales)

    # A step of 3 live rows (blocks 1, 2, 5: 5 just before the scratch block) padded to 16.
    tables, positions = [[0, 1], [2], [4, 5]], [5, 2, 7]
    slot_list = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
    ids = torch.tensor([3, 9, 17])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_list, device=DEVICE),
        block_size=bs,
        num_decodes=3,
        decode_block_tables=torch.tensor([t + [0] * (2 - len(t)) for t in tables], device=DEVICE),
        decode_seq_lens=torch.tensor(positions, device=DEVICE) + 1,
    )
    graphs.run(ids.to(DEVICE), torch.tensor(positions, device=DEVICE), meta)
    padded_ids = torch.cat([ids, torch.zeros(13, dtype=torch.int64)])
    padded_slots = torch.tensor(slot_list + [scratch * bs] * 13)
    write_all(ref_kv, ref_scales, padded_ids, padded_slots, kv_quant.write_int8)
    assert torch.equal(kv.cpu(), ref_kv) and torch.equal(scales.cpu(), ref_scales)
    assert torch.equal(kv_flat[-guard:], kv_guard) and torch.equal(sc_flat[-guard:], sc_guard)
