"""Reduced precision against references: bf16 against HF bf16, weight-only INT8 against the
bf16 and float32 weights, and every forced kernel path against the compiled one.

Stated bounds (measured; see the engine issue's closing note):
- bf16 greedy equals HF bf16 greedy for the first token of every prompt on every tiny
  preset (N = 1), but for at most one prompt whose top two HF logits are within two bf16
  steps (HF's own rounding depends on the CPU's ISA). Past that, rounding differences
  between two bf16 implementations of these deliberately peaky random models make
  sequences drift apart within a few tokens; float32 parity (tests/test_parity.py) is exact
  for all 24.
- INT8 weights on the trained smollm2-135m, 256 tokens of fixed text: logits within 5%
  (relative L2) of bf16's, greedy argmax agreeing at >= 90% of positions, and perplexity at
  most 3% above bf16's (measured on AVX2: 2.7% relative L2, 93% argmax agreement,
  perplexity +0.7%).
- W8A8 (INT8 weights and per-token INT8 activations, integer GEMMs) under bf16, same text:
  logits within 10% of bf16's, argmax agreeing at >= 80%, perplexity at most 5% above
  (measured on AVX512-VNNI: 6.7% relative L2, 87.5% argmax agreement, perplexity +1.3%;
  per-token activation scales without smoothing lose more than weight-only INT8 does).
- INT8 KV (per block and kv head) under bf16 weights, same text: the same bounds against
  bf16 KV (measured on AVX2: 2.2% relative L2, 93% argmax agreement, perplexity +1.1%;
  float32 against bf16 itself is 1.3% and 97%).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rtp_serve.engine import LLM, SamplingParams
from tests.helpers import PRESETS, REF_TOKENS, assert_pool_idle, make_llm, prompt_logits

_README = Path(__file__).resolve().parent.parent / "README.md"


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    lp = logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])
    return float((-lp.mean()).exp())


@pytest.mark.parametrize("preset", PRESETS)
def test_bfloat16_first_token_matches_hf_bfloat16(preset, model_dir, hf_model, prompts):
    llm = make_llm(model_dir(preset), "bfloat16")
    hf = hf_model(preset, torch.bfloat16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    exact = 0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt])).logits[0, -1].float()
        top = float(logits.max())
        exact += out.token_ids[0] == int(logits.argmax())
        # HF's bf16 GEMMs round by what the CPU has (oneDNN's AVX512-BF16 kernels differ from
        # its AVX2 ones), so where its top two are within two bf16 steps of each other, ours
        # may take either: a bf16 step at the top logit's size is 2^(floor(log2 |top|) - 7).
        tie = 2 * 2.0 ** (math.frexp(top)[1] - 1 - 7)
        assert float(logits[out.token_ids[0]]) >= top - tie, f"prompt of {len(prompt)} tokens"
    assert exact >= len(prompts) - 1
    assert_pool_idle(llm.engine)


@pytest.mark.parametrize(
    "weight_dtype,max_rel,min_agree,max_ppl",
    [("int8", 0.05, 0.9, 1.03), ("w8a8", 0.10, 0.8, 1.05)],
)
def test_int8_weights_against_bfloat16_on_a_trained_model(
    smollm2, weight_dtype, max_rel, min_agree, max_ppl
):
    from rtp_serve.core.tokenizer import Tokenizer

    ids = Tokenizer(smollm2).encode(_README.read_text())[:256]
    logits = {
        wd: prompt_logits(
            LLM(str(smollm2), dtype="bfloat16", weight_dtype=wd, num_kv_blocks=32), ids
        )
        for wd in ("auto", weight_dtype)
    }
    bf16, int8 = logits["auto"], logits[weight_dtype]
    rel = float((int8 - bf16).norm() / bf16.norm())
    agree = float((int8.argmax(-1) == bf16.argmax(-1)).float().mean())
    ppl_bf16, ppl_int8 = _perplexity(bf16, ids), _perplexity(int8, ids)
    assert rel < max_rel, rel
    assert agree >= min_agree, agree
    assert ppl_int8 <= max_ppl * ppl_bf16, (ppl_int8, ppl_bf16)


def test_int8_kv_against_bfloat16_kv_on_a_trained_model(smollm2):
    from rtp_serve.core.tokenizer import Tokenizer

    ids = Tokenizer(smollm2).encode(_README.read_text())[:256]
    logits = {
        kv: prompt_logits(LLM(str(smollm2), dtype="bfloat16", kv_dtype=kv, num_kv_blocks=32), ids)
        for kv in ("auto", "int8")
    }
    bf16, int8 = logits["auto"], logits["int8"]
    rel = float((int8 - bf16).norm() / bf16.norm())
    agree = float((int8.argmax(-1) == bf16.argmax(-1)).float().mean())
    ppl_bf16, ppl_int8 = _perplexity(bf16, ids), _perplexity(int8, ids)
    assert rel < 0.05, rel
    assert agree >= 0.9, agree
    assert ppl_int8 <= 1.03 * ppl_bf16, (ppl_int8, ppl_bf16)


FORCED = [
    # (dtype, weight_dtype): every linear storage the engine runs.
    ("float32", "auto"),
    ("bfloat16", "auto"),
    ("float32", "int8"),
    ("bfloat16", "int8"),
]


@pytest.mark.parametrize(("dtype", "weight_dtype"), FORCED)
def test_forced_reference_path_agrees_with_the_compiled_one(
    dtype, weight_dtype, model_dir, prompts, monkeypatch
):
    """RTP_SERVE_ISA=scalar (no compiled kernels: torch ops for every projection and for
    attention) computes what the compiled kernels compute, within the dtype's rounding."""
    path = model_dir("tiny-llama")
    compiled = make_llm(path, dtype, weight_dtype=weight_dtype)
    monkeypatch.setenv("RTP_SERVE_ISA", "scalar")
    reference = make_llm(path, dtype, weight_dtype=weight_dtype)
    assert reference.engine.runner.kernels.ops is None
    assert compiled.engine.runner.kernels.ops is not None
    prompt = prompts[6]
    a, b = prompt_logits(compiled, prompt), prompt_logits(reference, prompt)
    tol = 1e-4 if dtype == "float32" else 0.05
    assert float((a - b).norm() / b.norm()) < tol
    if dtype == "float32":
        greedy = SamplingParams(max_tokens=REF_TOKENS, temperature=0.0, ignore_eos=True)
        [x] = compiled.generate([prompt], greedy)
        [y] = reference.generate([prompt], greedy)
        assert x.token_ids == y.token_ids


def test_bfloat16_kv_under_a_float32_model(model_dir, prompts, hf_greedy):
    """--kv-dtype bfloat16 with float32 weights: twice the tokens in the same memory, a
    salt of its own, and greedy output that starts as float32's does."""
    path = model_dir("tiny-llama")
    budget = 1 << 20
    fp32 = LLM(str(path), dtype="float32", kv_cache_memory_bytes=budget)
    bf16kv = LLM(str(path), dtype="float32", kv_dtype="bfloat16", kv_cache_memory_bytes=budget)
    assert bf16kv.engine.runner.kv_cache.dtype == torch.bfloat16
    assert bf16kv.engine.limits.num_kv_blocks == 2 * fp32.engine.limits.num_kv_blocks
    assert bf16kv.engine.kv_layout.dtype == "bfloat16"
    assert bf16kv.engine.cache_salt != fp32.engine.cache_salt
    outs = bf16kv.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids[0] == hf_greedy("tiny-llama", prompt)[0][0]
    assert_pool_idle(bf16kv.engine)


def test_int8_kv_holds_twice_the_tokens_of_bfloat16(model_dir, prompts, hf_greedy):
    """--kv-dtype int8: >= 1.9x bf16's tokens in the same memory (the scales cost 4 bytes
    per block, layer and kv head), its own salt, and greedy output that starts as float32's."""
    path = model_dir("tiny-llama")
    budget = 1 << 20
    bf16kv = LLM(str(path), dtype="float32", kv_dtype="bfloat16", kv_cache_memory_bytes=budget)
    int8kv = LLM(str(path), dtype="float32", kv_dtype="int8", kv_cache_memory_bytes=budget)
    ratio = int8kv.engine.limits.num_kv_blocks / bf16kv.engine.limits.num_kv_blocks
    assert ratio >= 1.9, ratio
    runner = int8kv.engine.runner
    assert runner.kv_cache.dtype == torch.int8 and runner.kv_scales is not None
    used = runner.kv_cache.numel() + runner.kv_scales.numel() * 4
    assert used <= budget
    assert int8kv.engine.kv_layout.dtype == "int8"
    assert int8kv.engine.cache_salt not in (bf16kv.engine.cache_salt,)
    outs = int8kv.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids[0] == hf_greedy("tiny-llama", prompt)[0][0]
    assert_pool_idle(int8kv.engine)


def test_the_salt_separates_every_numerics():
    from rtp_serve.core.dtypes import kv_numerics

    assert kv_numerics("float32") == "float32"  # unchanged for the plain case
    assert kv_numerics("bfloat16", "auto", "bfloat16") == "bfloat16"
    names = {
        kv_numerics(d, w, k)
        for d in ("float32", "bfloat16")
        for w in ("auto", "int8")
        for k in ("auto", "float32", "bfloat16", "int8")
    }
    assert len(names) == 12  # kv "auto" is the dtype: 16 combinations, 12 distinct numerics
    with pytest.raises(ValueError, match="kv_dtype"):
        kv_numerics("float32", "auto", "int4")


def test_a_worker_reports_its_numerics_and_cpu(model_dir):
    """A worker process started with INT8 weights and bf16 KV says so in Stats, with the ISA
    it found, and its fixed KV budget holds twice the tokens of float32 KV."""
    import asyncio

    from rtp_serve.kernels.isa import cpu_isa
    from rtp_serve.services.common import grpc_util
    from rtp_serve.services.common.pb import worker_pb2, worker_pb2_grpc
    from tests.procs import grpc_service

    async def stats(address: str) -> worker_pb2.WorkerStats:
        async with grpc_util.channel(address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            return await stub.Stats(worker_pb2.WorkerStatsRequest(), timeout=10)

    flags = ("--model", str(model_dir("tiny-llama")), "--threads", "1", "--kv-cache-mib", "8")
    with grpc_service("fused", *flags, "--weight-dtype", "int8", "--kv-dtype", "bfloat16") as (
        address,
        _,
    ):
        s = asyncio.run(stats(address))
    assert (s.dtype, s.weight_dtype, s.kv_dtype) == ("float32", "int8", "bfloat16")
    assert s.cpu_isa == cpu_isa().describe()
    # INT8 projections run on the compiled kernels up to 128 rows ("1-2 rows_gemm, 3+
    # packed_gemm": which one where is this CPU's, gemm_table.py); past them (the buckets of
    # 256 and 1,024 rows) a prefill chunk may go to torch's GEMM over the dequantized weight
    # where the table measured it faster (tiny-llama's small shapes, some runs).
    # (An AVX512-BF16 CPU adds " + oneDNN prepacked bf16": what bf16 projections could use.)
    table = s.linear_kernels.removesuffix(" + oneDNN prepacked bf16")
    runs = [run.rsplit(" ", 1) for run in table.split(", ")]
    compiled = {"rows_gemm", "packed_gemm", "widen"}
    assert runs[0][0].startswith("1") and {k for _, k in runs} <= compiled | {"torch"}
    for rows, kernel in runs:
        if int(rows.split("-")[0].rstrip("+")) <= 128:
            assert kernel in compiled, table
    assert {"rows_gemm", "packed_gemm"} & {k for _, k in runs}
    # rtp_serve/kernels/backends.py, on a CPU that builds them
    assert s.attention_backend == "cpu-kernels"
    # tiny-llama: 4 layers x 2 kv heads x 32 dims x K and V x 2 bytes = 1 KiB per token.
    assert s.total_blocks * s.block_size == (8 << 20) // 1024
