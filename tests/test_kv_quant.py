"""The INT8 KV cache's writes: the adaptive per-block, per-head scale (rtp_serve/kernels/kv_quant.py)
and the compiled kernel against that reference."""

from __future__ import annotations

import os

import pytest
import torch

from rtp_serve.kernels import cpu, kv_quant

HEADS, DIM, BS, BLOCKS = 3, 16, 8, 12


def _writers():
    writers = [("reference", kv_quant.write_int8)]
    ops = cpu.load()
    if ops is not None:
        writers.append(("cpu-kernel", ops.kv_write_int8))
    elif os.environ.get("RTP_SERVE_CPU_KERNELS", "1") != "0":
        pytest.fail("the CPU kernel did not build (set RTP_SERVE_CPU_KERNELS=0 to run without)")
    return writers


def _fresh():
    cache = torch.full((BLOCKS * BS, HEADS, DIM), -128, dtype=torch.int8)
    return cache, torch.full((BLOCKS, HEADS), float("nan"))  # stale scales: never read


def _steps():
    """Scripted steps (slots written, values' magnitude): new blocks, a run continuing a
    block with larger values (the scale grows), one with smaller values (it does not), runs
    spanning blocks, and a block reused from offset 0 after holding large values."""
    torch.manual_seed(0)

    def rows(n, magnitude):
        return torch.randn(n, HEADS, DIM) * magnitude

    return [
        (list(range(0, 13)), rows(13, 1.0)),  # block 0 whole, block 1 offsets 0..4
        ([13, 14, 40], rows(3, 4.0)),  # block 1 grows; block 5 starts
        ([15, 41, 42], rows(3, 0.1)),  # smaller: no growth
        ([16, 17, 18, 19, 20, 21, 22, 23, 24, 25], rows(10, 2.0)),  # block 2, block 3 start
        (list(range(0, 5)), rows(5, 0.01)),  # block 0 reused: its old scale is forgotten
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_writer_matches_the_reference(dtype):
    results = {}
    for name, write in _writers():
        cache, scales = _fresh()
        for slots, x in _steps():
            write(cache, scales, x.to(dtype), torch.tensor(slots), BS)
        results[name] = cache, scales
    if len(results) < 2:
        pytest.skip("no compiled kernels on this machine")
    (ref_c, ref_s), (cpu_c, cpu_s) = results["reference"], results["cpu-kernel"]
    touched = torch.tensor(sorted({s // BS for slots, _ in _steps() for s in slots}))
    torch.testing.assert_close(cpu_s[touched], ref_s[touched], rtol=1e-6, atol=0)
    written = torch.tensor(sorted({s for slots, _ in _steps() for s in slots}))
    diff = (cpu_c[written].int() - ref_c[written].int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3


@pytest.mark.parametrize("name,write", _writers())
def test_scales_adapt_and_values_stay_within_a_step(name, write):
    cache, scales = _fresh()
    held: dict[int, torch.Tensor] = {}
    for slots, x in _steps():
        write(cache, scales, x, torch.tensor(slots), BS)
        for s, row in zip(slots, x, strict=True):
            if s % BS == 0:  # a block restarted: forget what it held
                held = {k: v for k, v in held.items() if k // BS != s // BS}
            held[s] = row
    for block in sorted({s // BS for s in held}):
        rows = {s: r for s, r in held.items() if s // BS == block}
        amax = torch.stack(list(rows.values())).abs().amax(dim=(0, 2))  # [H]
        # The scale fits the block's largest value exactly: nothing clips, no step is wasted.
        torch.testing.assert_close(scales[block], amax / 127, rtol=1e-6, atol=0)
        for s, row in rows.items():
            err = (cache[s].float() * scales[block][:, None] - row).abs()
            # Half a step from rounding, plus half a step per requantization (at most two
            # growths in these steps).
            assert bool((err <= 1.5 * scales[block][:, None] + 1e-7).all()), (name, s)
    # Block 0 was restarted with values 100x smaller: its scale shrank with them.
    assert float(scales[0].max()) < 0.01
    assert int(cache[list(range(0, 5))].abs().max()) == 127


@pytest.mark.parametrize("name,write", _writers())
def test_zero_rows_quantize_to_zero(name, write):
    cache, scales = _fresh()
    write(cache, scales, torch.zeros(4, HEADS, DIM), torch.arange(4), BS)
    assert int(cache[:4].abs().max()) == 0 and float(scales[0].abs().max()) == 0.0
    x = torch.randn(2, HEADS, DIM)  # then real values continue the block
    write(cache, scales, x, torch.arange(4, 6), BS)
    assert int(cache[:4].abs().max()) == 0
    err = (cache[4:6].float() * scales[0][:, None] - x).abs()
    assert bool((err <= 0.5 * scales[0][:, None] + 1e-7).all())
