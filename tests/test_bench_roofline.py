"""bench/roofline.py: a workload's FLOPs as torch's own counter sees the HF model compute them,
and the served floor's closed forms against a token-by-token count."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bench import roofline
from rtp_serve.core.model_config import ModelConfig, RopeScaling


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_prefill_flops_are_what_torchs_counter_counts_in_hf(
    model_dir: Callable[[str], Path], preset: str
):
    """HF's eager attention computes the whole p x p score matrix (the causal mask applied
    after), so torch's FLOP counter sees every query-key pair: the projections (with GQA's
    narrower k and v, and qwen2's biases) as matrix products, one LM-head row, and the
    pairs as batched products."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    path = model_dir(preset)
    cfg = ModelConfig.from_dir(path)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    p = 37
    ids = torch.randint(10, cfg.vocab_size, (1, p), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        hf.eval()(ids, logits_to_keep=1)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    products = counts.pop("aten.mm", 0) + counts.pop("aten.addmm", 0)
    assert products == 2 * roofline.projection_params(cfg) * p + 2 * roofline.head_params(cfg)
    assert counts == {"aten.bmm": roofline.attention_flops_per_pair(cfg) * p * p}


def test_served_floor_is_the_sum_over_every_token():
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64, intermediate_size=96,
        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1e4, rope_scaling=RopeScaling(),
        max_position_embeddings=512, tie_word_embeddings=False, attention_bias=False,
        eos_token_ids=(), bos_token_id=None,
    )  # fmt: skip
    lens = [(5, 3), (2, 1), (4, 4), (7, 2)]
    machine = roofline.Machine(
        bandwidth=3e8, read_bandwidth=1e8, fp32_peak=1e9, bf16_peak=2e9, w8a8_peak=4e9
    )
    params = 3 * (64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 96)
    head = 64 * 300
    pair = 4 * 3 * 4 * 16
    kv_token = 2 * 3 * 2 * 16  # elements
    prefill = gemm = attention = context = 0
    for p, o in lens:
        prefill += 2 * head  # the first token's LM-head row
        for i in range(p):  # the i-th prompt token attends itself and those before it
            prefill += 2 * params + pair * (i + 1)
        for k in range(1, o):  # each later token, its context p + k keys
            gemm += 2 * (params + head)
            attention += pair * (p + k)
            context += p + k
    decode_tokens = sum(o - 1 for _, o in lens)
    for dtype, item, peak in (("float32", 4, 1e9), ("bfloat16", 2, 2e9)):
        f = roofline.served_floor(cfg, lens, 2, machine, dtype)
        weights = (params + head) * item * math.ceil(decode_tokens / 2)  # 2 streams a step
        kv = kv_token * item * context
        assert (f.requests, f.prompt_tokens, f.decode_tokens) == (4, 18, decode_tokens)
        assert (f.prefill_flops, f.decode_gemm_flops, f.decode_attention_flops) == (
            prefill, gemm, attention,
        )  # fmt: skip
        assert (f.weight_bytes, f.kv_bytes) == (weights, kv)
        assert f.prefill_s == pytest.approx(prefill / peak)
        assert f.serial_s == pytest.approx(
            prefill / peak + max(gemm / peak, weights / 1e8) + max(attention / peak, kv / 1e8)
        )
        assert f.roofline_s == pytest.approx(
            prefill / peak + max((gemm + attention) / peak, (weights + kv) / 1e8)
        )
        assert f.prefill_s < f.roofline_s <= f.serial_s
    # All at once (None) and a cap above the load's size stream every request each step.
    at_once = roofline.served_floor(cfg, lens, None, machine)
    assert at_once.weight_bytes == roofline.served_floor(cfg, lens, 64, machine).weight_bytes
    assert at_once.weight_bytes == (params + head) * 4 * math.ceil(decode_tokens / 4)


def test_the_best_of_two_measurements_keeps_each_ceilings_higher_value():
    a = roofline.Machine(50e9, 30e9, 190e9, math.nan, math.nan)
    b = roofline.Machine(48e9, 60e9, 220e9, math.nan, 5e11)
    best = a.best(b)
    assert (best.bandwidth, best.read_bandwidth, best.fp32_peak, best.w8a8_peak) == (
        50e9, 60e9, 220e9, 5e11,
    )  # fmt: skip
    assert math.isnan(best.bf16_peak)  # measured by neither
    assert best.peak("float32") == 220e9 and math.isnan(best.peak("bfloat16"))
