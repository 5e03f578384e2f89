"""Multi-LoRA in the engine against HF transformers + peft (float32): greedy tokens and
logprobs for single adapters and for one batch mixing adapters and the base model; the
block-hash namespaces of adapters; the bounded resident set (LRU swap)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rtp_serve.core.peft_config import AdapterError, LoraConfig, UnknownAdapterError
from rtp_serve.engine import LLM, SamplingParams
from rtp_serve.engine.lora.stacked import Stacked, StackedRows, stack_pairs
from rtp_serve.engine.lora.weights import LoraPair, LoraPart
from rtp_serve.kernels import cpu
from rtp_serve.models.make_adapter import build_adapter
from tests.helpers import assert_pool_idle

STEPS = 10
PARAMS = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=3)
# name -> (rank, seed, targets): full, partial fused (q, v only: k's columns stay base),
# MLP only, another full one.
ADAPTERS = {
    "a1": (8, 1, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "a2": (4, 2, ("q_proj", "v_proj")),
    "a3": (6, 3, ("up_proj", "down_proj", "o_proj")),
    "a4": (8, 4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
}


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Callable[[str, str], Path]:
    root = tmp_path_factory.mktemp("adapters")
    built: dict[tuple[str, str], Path] = {}

    def get(preset: str, name: str) -> Path:
        if (preset, name) not in built:
            rank, seed, targets = ADAPTERS[name]
            out = root / f"{preset}-{name}"
            built[preset, name] = build_adapter(preset, out, rank, seed=seed, targets=targets)
        return built[preset, name]

    return get


@pytest.fixture(scope="module")
def peft_greedy(model_dir, adapter_dir):
    """`peft_greedy(preset, adapter or "", prompt)` -> (tokens, logprobs [STEPS, V])."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models: dict[str, PeftModel] = {}

    def get(preset: str, name: str, prompt: list[int]):
        if preset not in models:  # a model of its own: peft rewrites the modules it wraps
            hf = AutoModelForCausalLM.from_pretrained(model_dir(preset), dtype=torch.float32)
            peft = PeftModel.from_pretrained(hf, adapter_dir(preset, "a1"), adapter_name="a1")
            for other in ADAPTERS:
                if other != "a1":
                    peft.load_adapter(adapter_dir(preset, other), adapter_name=other)
            models[preset] = peft.eval()
        model = models[preset]
        ids = torch.tensor([prompt])
        kwargs = dict(
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=STEPS,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        with torch.inference_mode():
            if name:
                model.set_adapter(name)
                g = model.generate(input_ids=ids, **kwargs)
            else:
                with model.disable_adapter():
                    g = model.generate(input_ids=ids, **kwargs)
        logprobs = torch.stack([s[0] for s in g.logits]).float().log_softmax(-1)
        return g.sequences[0, len(prompt) :].tolist(), logprobs

    return get


def make_llm(model_dir, adapter_dir, preset: str, names, dtype="float32", **args) -> LLM:
    loras = tuple((n, str(adapter_dir(preset, n))) for n in names)
    return LLM(str(model_dir(preset)), dtype=dtype, num_kv_blocks=64, loras=loras, **args)


def assert_matches(out, ref) -> None:
    tokens, logprobs = ref
    assert out.token_ids == tokens
    for step, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(logprobs[step, lp.token_id].item(), abs=1e-4)
        for tok, value in lp.top.items():
            assert value == pytest.approx(logprobs[step, tok].item(), abs=1e-4)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_single_adapter_matches_peft(preset, model_dir, adapter_dir, peft_greedy, prompts):
    llm = make_llm(model_dir, adapter_dir, preset, ["a1"])
    prompt = prompts[4]
    [out] = llm.generate([prompt], PARAMS, lora="a1")
    assert_matches(out, peft_greedy(preset, "a1", prompt))
    [base] = llm.generate([prompt], PARAMS)
    assert base.token_ids != out.token_ids  # the adapter changes the output
    assert_matches(base, peft_greedy(preset, "", prompt))
    assert_pool_idle(llm.engine)


@pytest.mark.parametrize("max_loras", [4, 2])
def test_mixed_batch_matches_peft(max_loras, model_dir, adapter_dir, peft_greedy, prompts):
    """One batch: three adapters (full, partial qkv, MLP-only) and the base model, rows
    interleaved. With max_loras=2 the scheduler holds rows back and the registry swaps."""
    preset = "tiny-llama"
    llm = make_llm(model_dir, adapter_dir, preset, ["a1", "a2", "a3"], max_loras=max_loras)
    names = ["a1", "", "a2", "a3", "a1", "a3", "", "a2"]
    outs = llm.generate(prompts, PARAMS, lora=names)
    for prompt, name, out in zip(prompts, names, outs, strict=True):
        assert_matches(out, peft_greedy(preset, name, prompt))
    stats = llm.engine.adapters.stats()
    assert len(stats.resident) <= max_loras
    if max_loras == 2:
        assert stats.evictions > 0
    assert_pool_idle(llm.engine)


# bf16 against our float32 (which matches peft to 1e-4, above): the first token's top-20
# logprobs of a batch mixing two adapters and the base. Measured on tiny-llama: at least 15
# of the 20 tokens shared and those at most 0.24 apart (the base rows alike: bf16's own
# rounding, not the low-rank update's), while an adapter leaves few of the base's top 20.
BF16_LOGPROB_TOL = 0.35


def test_bfloat16_adapters_match_float32(model_dir, adapter_dir, prompts):
    names = ["a1", "", "a3", "a1", "a3", ""]
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=20)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = make_llm(model_dir, adapter_dir, "tiny-llama", ["a1", "a3"], dtype=dtype)
        runs[dtype] = [o.logprobs[0] for o in llm.generate(prompts[:6], first, lora=names)]
        if dtype == "float32":
            runs["base"] = [o.logprobs[0] for o in llm.generate(prompts[:6], first)]
    rows = zip(names, runs["float32"], runs["bfloat16"], runs["base"], strict=True)
    for name, ref, bf16, base in rows:
        common = set(ref.top) & set(bf16.top)
        assert len(common) >= 15, name
        error = max(abs(ref.top[t] - bf16.top[t]) for t in common)
        assert error <= BF16_LOGPROB_TOL, (name, error)
        # bf16's greedy token is float32's, or one tied with it within the tolerance.
        assert bf16.top.get(ref.token_id, -1e9) >= bf16.logprob - BF16_LOGPROB_TOL, name
        if name:  # the update is there in bf16: it changes the top 20 more than bf16 does
            assert len(set(ref.top) & set(base.top)) < len(common) - 5, name


def test_lru_swap_keeps_outputs(model_dir, adapter_dir, peft_greedy, prompts):
    """One resident slot, four adapters in turn and again: reloaded from disk each time."""
    preset = "tiny-llama"
    llm = make_llm(model_dir, adapter_dir, preset, list(ADAPTERS), max_loras=1)
    prompt = prompts[2]
    for name in [*ADAPTERS, "a1"]:
        [out] = llm.generate([prompt], PARAMS, lora=name)
        assert_matches(out, peft_greedy(preset, name, prompt))
    stats = llm.engine.adapters.stats()
    assert stats.resident == ("a1",)
    assert stats.evictions == 4


def test_worker_metrics_count_adapter_loads_swaps_and_requests(model_dir, adapter_dir, prompts):
    """One resident slot, two adapters: a1, a3, a1 swap twice; the worker's families export
    the registry's counts (each call adds what is new) and drop an adapter no longer served."""
    from prometheus_client import CollectorRegistry

    from rtp_serve.services.worker.metrics import WorkerFamilies, WorkerMetrics

    registry = CollectorRegistry()
    metrics = WorkerMetrics(WorkerFamilies(registry), "fused", "m")
    llm = make_llm(model_dir, adapter_dir, "tiny-llama", ["a1", "a3"], max_loras=1)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompts[0]], params, lora="a1")
    metrics.lora(llm.engine.adapters.stats())
    for name in ("a3", "a1"):
        llm.generate([prompts[0]], params, lora=name)
    llm.generate([prompts[1]], params)  # the base model counts under no adapter
    metrics.lora(llm.engine.adapters.stats())

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(
            f"rtp:{name}", {"role": "fused", "model_name": "m"} | labels
        )

    assert value("lora_adapter_loads_total") == 4  # two registered, two swapped back in
    assert value("lora_adapter_swaps_total") == 2
    assert value("lora_adapter_evictions_total") == 2
    assert value("lora_requests_total", adapter="a1") == 2
    assert value("lora_requests_total", adapter="a3") == 1
    assert [value("lora_adapters", kind=k) for k in ("served", "resident", "max")] == [2, 1, 1]
    assert value("lora_adapter_resident", adapter="a1") == 1
    assert value("lora_adapter_resident", adapter="a3") == 0
    llm.engine.adapters.remove("a3")
    metrics.lora(llm.engine.adapters.stats())
    assert value("lora_adapter_resident", adapter="a3") is None
    assert value("lora_adapters", kind="served") == 1


def test_adapters_never_share_cached_blocks(model_dir, adapter_dir, prompts):
    llm = make_llm(model_dir, adapter_dir, "tiny-llama", ["a1", "a4"])
    engine = llm.engine
    prompt = prompts[7]  # 70 tokens: 4 full blocks
    params = SamplingParams(max_tokens=2, temperature=0.0)
    keys = {n: engine.make_request(n, prompt, params, lora=n).block_hashes for n in ("a1", "a4")}
    keys[""] = engine.make_request("base", prompt, params).block_hashes
    assert len(keys["a1"]) == 4
    assert not set(keys["a1"]) & set(keys["a4"])
    assert not set(keys[""]) & (set(keys["a1"]) | set(keys["a4"]))
    [first] = llm.generate([prompt], params, lora="a1")
    [other] = llm.generate([prompt], params, lora="a4")
    [base] = llm.generate([prompt], params)
    [again] = llm.generate([prompt], params, lora="a1")
    assert (first.num_cached_tokens, other.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens == 64  # its own namespace still hits


def test_unknown_adapter_is_named(model_dir, adapter_dir, prompts):
    llm = make_llm(model_dir, adapter_dir, "tiny-llama", ["a1"])
    with pytest.raises(UnknownAdapterError, match="`nope`"):
        llm.generate([prompts[0]], PARAMS, lora="nope")
    llm.engine.adapters.remove("a1")
    with pytest.raises(UnknownAdapterError, match="`a1`"):
        llm.generate([prompts[0]], PARAMS, lora="a1")


def test_peft_config_checks(adapter_dir, tmp_path):
    src = adapter_dir("tiny-llama", "a2")
    cfg = LoraConfig.load("a2", src)
    assert (cfg.rank, cfg.scaling, cfg.targets) == (4, 1.0, frozenset({"q_proj", "v_proj"}))

    def variant(**fields) -> Path:
        d = tmp_path / "-".join(fields)
        d.mkdir()
        config = json.loads((src / "adapter_config.json").read_text()) | fields
        (d / "adapter_config.json").write_text(json.dumps(config))
        (d / "adapter_model.safetensors").write_bytes(
            (src / "adapter_model.safetensors").read_bytes()
        )
        return d

    assert LoraConfig.load("rs", variant(use_rslora=True)).scaling == pytest.approx(4 / 2)
    with pytest.raises(AdapterError, match="use_dora"):
        LoraConfig.load("dora", variant(use_dora=True))
    with pytest.raises(AdapterError, match="embed_tokens"):
        LoraConfig.load("emb", variant(target_modules=["q_proj", "embed_tokens"]))
    with pytest.raises(AdapterError, match="adapter_config.json"):
        LoraConfig.load("none", tmp_path)
    # Same content, another name: the same fingerprint (and so the same KV namespace).
    assert LoraConfig.load("copy", variant(r=4)).fingerprint == cfg.fingerprint


def _random_pair(
    g: torch.Generator, fan_in: int, widths: list[int], rank: int, targeted: list[int]
):
    """One adapter's fused projection: parts `targeted` (indexes into `widths`) of rank
    `rank`, the others untouched."""
    starts = [sum(widths[:i]) for i in range(len(widths))]
    parts = [
        LoraPart(
            slice(j * rank, (j + 1) * rank),
            slice(starts[i], starts[i] + widths[i]),
            torch.randn(rank, widths[i], generator=g),
        )
        for j, i in enumerate(targeted)
    ]
    return LoraPair(torch.randn(fan_in, rank * len(targeted), generator=g), tuple(parts))


@pytest.mark.parametrize(
    "names",
    [
        ["a"],  # one row: fewer adapters than threads
        ["a", "a", "a"],  # one adapter, several rows
        ["b", "", "a", "c", "a", "", "c", "b"],  # every adapter, base rows among them
        ["c", "b", "a", "d"] * 5,  # more rows than threads, "d" not resident
    ],
    ids=["one", "shared", "mixed", "many"],
)
@pytest.mark.parametrize("tail", [0, 5], ids=["decode-only", "with-prefill-rows"])
def test_lora_rows_kernel_matches_the_masked_gemms_and_each_row_alone(names, tail):
    """The compiled decode-row kernel against the masked GEMMs over the stacked adapters
    and against each row's own update: adapters of different ranks, partly targeted fused
    projections (q and v of q/k/v), rows on the base model, and rows after the decode rows
    (a prefill chunk's) left alone."""
    ops = cpu.load()
    if ops is None or not hasattr(ops, "lora_rows"):
        pytest.fail("the CPU kernels did not build (set RTP_SERVE_CPU_KERNELS=0 to run without)")
    g = torch.Generator().manual_seed(len(names) * 10 + tail)
    fan_in, widths = 96, [64, 32, 32]
    pairs = {
        "a": _random_pair(g, fan_in, widths, 8, [0, 1, 2]),
        "b": _random_pair(g, fan_in, widths, 4, [0, 2]),
        "c": _random_pair(g, fan_in, widths, 6, [1]),
    }
    resident = sorted(pairs)
    stacked = Stacked(
        tuple(resident), [(stack_pairs(list(enumerate(pairs[n] for n in resident))),)]
    )
    x = torch.randn(len(names) + tail, fan_in, generator=g)
    y0 = torch.randn(len(names) + tail, sum(widths), generator=g)
    want = y0.clone()
    for i, name in enumerate(names):
        if name in pairs:
            pairs[name].add(x[i : i + 1], want[i : i + 1])
    for kernel in (ops.lora_rows, None):
        y = y0.clone()
        StackedRows(stacked, names, torch.float32, kernel).add(0, 0, x, y)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)  # summation order only
