"""CUDA-graph bookkeeping on CPU: padding to the captured sizes, persistent buffers, padded
rows' slots. The capture here replays eagerly over the same buffers (what a graph replay
does on a GPU), around the real model of the tiny preset."""

from __future__ import annotations

import torch

from rtp_serve.engine.config import EngineConfig
from rtp_serve.engine.cuda_graphs import DecodeGraphs, padded_size
from rtp_serve.engine.llm_engine import LLMEngine
from rtp_serve.kernels.attention import AttentionMetadata, PrefillChunk


def test_padded_size_is_the_next_captured_size():
    sizes = (1, 2, 4, 8)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert padded_size(9, sizes) is None
    assert padded_size(3, (8, 2)) == 8  # in any order


def _decode_meta(tables, positions, bs):
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
    width = max(map(len, tables))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_size=bs,
        num_decodes=len(tables),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_seq_lens=torch.tensor(positions) + 1,
    )


def test_decode_step_through_graphs_matches_eager(model_dir, monkeypatch):
    # The graph runs 4 rows where eager runs 3; measured kernel tables may pick a different
    # GEMM for each row count (their float32 sums then differ by ~1e-5, beyond this
    # comparison): the fixed split runs one kernel for both, so the graph is what differs.
    monkeypatch.setenv("RTP_SERVE_GEMM_TUNE", "0")
    engine = LLMEngine(EngineConfig(model=str(model_dir("tiny-llama")), num_kv_blocks=16))
    runner = engine.runner
    bs, scratch = runner.block_size, 15  # no sequence here uses block 15
    captured = []

    def capture(fn):
        captured.append(fn)
        return fn

    graphs = DecodeGraphs(runner._forward, (4, 1, 2), 4, scratch, bs, torch.device("cpu"), capture)
    assert graphs.sizes == (1, 2, 4) and len(captured) == 3  # each size captured once, at start
    buffers = {name: getattr(graphs.buffers, name).data_ptr() for name in graphs.buffers.__slots__}

    torch.manual_seed(0)
    runner.kv_cache.normal_()  # any cached context will do
    before = runner.kv_cache.clone()
    tables, positions = [[0], [1, 2], [3]], [5, 17, 9]
    ids, pos = torch.tensor([7, 8, 9]), torch.tensor(positions)
    meta = _decode_meta(tables, positions, bs)
    eager = runner._forward(ids, pos, meta, torch.arange(3))
    after_eager = runner.kv_cache.clone()

    runner.kv_cache.copy_(before)
    got = graphs.run(ids, pos, meta)  # 3 rows: graph 4, one padding row
    assert got.shape == eager.shape
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), eager.argmax(-1))
    b = graphs.buffers
    assert b.slot_mapping[3] == scratch * bs and b.seq_lens[3] == 1
    assert torch.equal(b.block_tables[3], torch.full((4,), scratch))
    assert (b.block_tables[1, 2:] == scratch).all()  # a table's unused tail, too
    # The padding row wrote its K/V into the scratch slot and nowhere else.
    slots = runner.kv_cache.shape[2]
    elsewhere = torch.ones(slots, dtype=torch.bool)
    elsewhere[scratch * bs] = False
    assert torch.equal(runner.kv_cache[:, :, elsewhere], after_eager[:, :, elsewhere])
    assert not torch.equal(runner.kv_cache[:, :, scratch * bs], before[:, :, scratch * bs])

    # A smaller step reuses the same buffers (graph 2, no padding); no capture happens.
    two = graphs.run(ids[:2], pos[:2], _decode_meta(tables[:2], positions[:2], bs))
    assert two.shape[0] == 2 and len(captured) == 3
    assert buffers == {n: getattr(b, n).data_ptr() for n in b.__slots__}
    assert b.slot_mapping[2:].tolist() == [scratch * bs] * 2

    # No graph for more rows than the largest size, nor for a step with a prefill.
    five = _decode_meta([[0]] * 5, [1] * 5, bs)
    assert graphs.run(torch.zeros(5, dtype=torch.int64), torch.ones(5), five) is None
    mixed = AttentionMetadata(
        meta.slot_mapping, bs, 2, meta.decode_block_tables[:2], meta.decode_seq_lens[:2],
        [PrefillChunk(2, 1, 9, torch.tensor([3]))],
    )  # fmt: skip
    assert graphs.run(ids, pos, mixed) is None
