"""Our engine against HF transformers: greedy tokens, logits and logprobs (float32).

Every scheduling path (one prompt, a batch, staggered arrivals, chunked prefill, prefix-cache
hits, preemption and recompute) must produce exactly HF's greedy continuation.
"""

from __future__ import annotations

import pytest
import torch

from rtp_serve.engine import LLM, SamplingParams
from tests import helpers
from tests.helpers import PRESETS, REF_TOKENS, assert_pool_idle, drive, prompt_logits

GREEDY = SamplingParams(max_tokens=REF_TOKENS, temperature=0.0, ignore_eos=True)


def make_llm(model_dir, preset: str, dtype: str = "float32", **engine_args) -> LLM:
    return helpers.make_llm(model_dir(preset), dtype, **engine_args)


@pytest.mark.parametrize("preset", PRESETS)
def test_single_prompt_matches_hf(preset, model_dir, hf_greedy, prompts):
    llm = make_llm(model_dir, preset)
    prompt = prompts[4]
    [out] = llm.generate([prompt], GREEDY)
    assert out.token_ids == hf_greedy(preset, prompt)[0]
    assert out.finish_reason == "length"
    assert out.prompt_token_ids == prompt
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert_pool_idle(llm.engine)


BATCH_CASES = [
    *[pytest.param(p, {}, id=f"{p}-default") for p in PRESETS],
    # A token budget below most prompt lengths: decodes and prefill chunks share each step.
    *[pytest.param(p, {"max_num_batched_tokens": 16}, id=f"{p}-budget16") for p in PRESETS],
    pytest.param("tiny-llama", {"max_num_seqs": 3}, id="tiny-llama-3seqs"),
    pytest.param("tiny-llama", {"block_size": 8}, id="tiny-llama-block8"),
    pytest.param("tiny-llama", {"enable_prefix_caching": False}, id="tiny-llama-nocache"),
    # The torch reference attention (CUDA, or no compiler) instead of the CPU kernel.
    pytest.param("tiny-llama", {"torch_attention": True}, id="tiny-llama-torch-attn"),
    pytest.param("tiny-qwen2", {"torch_attention": True}, id="tiny-qwen2-torch-attn"),
]


@pytest.mark.parametrize(("preset", "engine_args"), BATCH_CASES)
def test_batch_matches_hf(preset, engine_args, model_dir, hf_greedy, prompts):
    engine_args = dict(engine_args)
    torch_attention = engine_args.pop("torch_attention", False)
    llm = make_llm(model_dir, preset, **engine_args)
    if torch_attention:
        helpers.use_torch_attention(llm.engine)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(preset, prompt)[0], f"prompt of {len(prompt)} tokens"
    assert_pool_idle(llm.engine)


@pytest.mark.parametrize("preset", PRESETS)
def test_staggered_arrivals_match_hf(preset, model_dir, hf_greedy, prompts):
    engine = make_llm(model_dir, preset, max_num_batched_tokens=64).engine
    reqs = [engine.make_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    # Later arrivals join while earlier ones are mid-prefill or decoding.
    final, streamed = drive(engine, {0: reqs[:3], 2: reqs[3:5], 3: reqs[5:6], 7: reqs[6:]})
    for req in reqs:
        out = final[req.request_id]
        assert out.token_ids == hf_greedy(preset, req.prompt_token_ids)[0]
        assert streamed[req.request_id] == out.token_ids
    assert_pool_idle(engine)


@pytest.mark.parametrize("preset", PRESETS)
def test_chunked_prefill_matches_hf(preset, model_dir, hf_greedy, prompts):
    engine = make_llm(model_dir, preset, max_num_batched_tokens=16).engine
    prompt = prompts[7]
    assert len(prompt) == 70
    engine.add_request(engine.make_request("long", prompt, GREEDY))
    steps_to_first_token = 0
    while True:
        steps_to_first_token += 1
        outs = engine.step()
        engine.check_integrity()
        if outs:
            break
    assert steps_to_first_token == -(-70 // 16)  # five chunks of at most 16 tokens
    final, _ = drive(engine, {})
    assert final["long"].token_ids == hf_greedy(preset, prompt)[0]
    assert_pool_idle(engine)


@pytest.mark.parametrize("preset", PRESETS)
def test_prefix_cache_hits_match_hf(preset, model_dir, hf_greedy, corpus_ids):
    shared = corpus_ids[10:60]  # 50 tokens: three full 16-token blocks
    a = shared + corpus_ids[150:156]
    b = shared + corpus_ids[170:178]
    c = corpus_ids[80:144]  # exactly four blocks: the last must still be computed
    d = shared + corpus_ids[200:240]  # after the hit, 42 new tokens over three blocks
    llm = make_llm(model_dir, preset)

    [out_a] = llm.generate([a], GREEDY)
    [out_b] = llm.generate([b], GREEDY)
    [out_c1] = llm.generate([c], GREEDY)
    [out_c2] = llm.generate([c], GREEDY)
    [out_d] = llm.generate([d], GREEDY)
    assert out_a.num_cached_tokens == 0
    assert out_b.num_cached_tokens == 48
    assert out_c1.num_cached_tokens == 0
    assert out_c2.num_cached_tokens == 48
    assert out_d.num_cached_tokens == 48
    for prompt, out in [(a, out_a), (b, out_b), (c, out_c1), (c, out_c2), (d, out_d)]:
        assert out.num_cached_tokens % 16 == 0
        assert out.token_ids == hf_greedy(preset, prompt)[0]
    assert_pool_idle(llm.engine)

    # Submitted together: b reuses blocks a writes in the very same step.
    llm = make_llm(model_dir, preset)
    out_a, out_b = llm.generate([a, b], GREEDY)
    assert (out_a.num_cached_tokens, out_b.num_cached_tokens) == (0, 48)
    assert out_a.token_ids == hf_greedy(preset, a)[0]
    assert out_b.token_ids == hf_greedy(preset, b)[0]
    assert_pool_idle(llm.engine)


PREEMPT_CASES = [
    *[pytest.param(p, True, id=f"{p}-cache") for p in PRESETS],
    pytest.param("tiny-llama", False, id="tiny-llama-nocache"),
]


@pytest.mark.parametrize(("preset", "caching"), PREEMPT_CASES)
def test_preemption_matches_hf(preset, caching, model_dir, hf_greedy, prompts):
    # 8 blocks of 16 = 128 tokens: the longest request (70 + 24) fits alone, all 8 cannot.
    engine = make_llm(model_dir, preset, num_kv_blocks=8, enable_prefix_caching=caching).engine
    reqs = [engine.make_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    final, _ = drive(engine, {0: reqs})
    assert sum(r.num_preemptions for r in reqs) > 0, "the pool was meant to force preemption"
    for req in reqs:
        assert final[req.request_id].token_ids == hf_greedy(preset, req.prompt_token_ids)[0]
    assert_pool_idle(engine)


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_logits_match_hf(preset, model_dir, hf_model, prompts):
    """Logits of every prompt position from our model forward equal HF's (float32)."""
    prompt = prompts[6]
    ours = prompt_logits(make_llm(model_dir, preset, num_kv_blocks=8), prompt)
    with torch.inference_mode():
        ref = hf_model(preset)(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_prefill_logits_match_hf_with_mlp_in_slices(model_dir, hf_model, prompts, monkeypatch):
    """A chunk whose MLP runs in uneven slices of rows (as a large prefill chunk's does)
    gives every position HF's logits."""
    from rtp_serve.engine.models import llama

    llm = make_llm(model_dir, "tiny-llama", num_kv_blocks=8)
    cfg = llm.engine.model_config
    row_bytes = 2 * cfg.intermediate_size * 4  # float32 gate_up output per row
    monkeypatch.setattr(llama, "MLP_SLICE_BYTES", 12 * row_bytes)  # 70 rows: 5 x 12, 10
    sliced = []
    whole = llama.LlamaModel._mlp_rows

    def spy(self, i, layer, x, lora):
        sliced.append(x.shape[0])
        return whole(self, i, layer, x, lora)

    monkeypatch.setattr(llama.LlamaModel, "_mlp_rows", spy)
    prompt = prompts[7]
    ours = prompt_logits(llm, prompt)
    assert sliced == ([12] * 5 + [10]) * cfg.num_layers
    with torch.inference_mode():
        ref = hf_model("tiny-llama")(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset", PRESETS)
def test_logprobs_match_hf(preset, model_dir, hf_greedy, prompts):
    """Sampled-token and top-n logprobs at every step (prefill and decode) equal HF's."""
    llm = make_llm(model_dir, preset, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    chosen = [prompts[1], prompts[5], prompts[7]]
    for prompt, out in zip(chosen, llm.generate(chosen, params), strict=True):
        tokens, ref = hf_greedy(preset, prompt, 12)
        assert out.token_ids == tokens
        assert len(out.logprobs) == 12
        for step, lp in enumerate(out.logprobs):
            assert lp.token_id == tokens[step]
            assert lp.logprob == pytest.approx(ref[step, lp.token_id].item(), abs=1e-4)
            assert len(lp.top) == 5
            for token_id, value in lp.top.items():
                assert value == pytest.approx(ref[step, token_id].item(), abs=1e-4)
            # Compare values, not ids: two near-equal alternatives may swap rank.
            ref_top = ref[step].topk(5).values.tolist()
            assert sorted(lp.top.values(), reverse=True) == pytest.approx(ref_top, abs=1e-4)
            assert lp.logprob == pytest.approx(max(lp.top.values()), abs=1e-6)  # greedy
    assert_pool_idle(llm.engine)


def test_logprobs_zero_returns_sampled_only(model_dir, hf_greedy, prompts):
    llm = make_llm(model_dir, "tiny-llama")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    [out] = llm.generate([prompts[3]], params)
    _, ref = hf_greedy("tiny-llama", prompts[3], 4)
    assert [lp.top for lp in out.logprobs] == [{}] * 4
    for step, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(ref[step, lp.token_id].item(), abs=1e-4)
    [plain] = llm.generate([prompts[3]], SamplingParams(max_tokens=4, temperature=0.0))
    assert plain.logprobs is None
