"""An ISA level forced below the CPU's (RTP_SERVE_ISA) caps torch's libraries too, so the
process runs what a machine of that level would: ATen's vectorized ops, oneDNN's GEMMs and
MKL, as each of them reports it (torch's own capability, oneDNN's verbose log), and vLLM's
kernel choice when a benchmark runs it (bench/isa_cap). The greedy text stays HF's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve import vllm_env
from rtp_serve.kernels.isa import LEVELS, cap_libraries, cpu_isa, library_caps, resolve

ROOT = Path(__file__).resolve().parents[1]
_AVX512_BF16 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
above_avx2 = pytest.mark.skipif(
    LEVELS.index(cpu_isa().hardware) <= LEVELS.index("avx2"),
    reason="this CPU has nothing above AVX2 to cap",
)


def test_only_a_level_forced_below_the_hardware_caps_the_libraries():
    assert library_caps(resolve(_AVX512_BF16, None)) == {}
    assert library_caps(resolve(_AVX512_BF16, "avx512_bf16")) == {}  # not below
    assert library_caps(resolve(_AVX512_BF16, "scalar")) == {}  # no kernels, not a CPU
    assert library_caps(resolve(_AVX512_BF16, "avx2")) == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert library_caps(resolve(_AVX512_BF16, "avx512"))["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    amx = _AVX512_BF16 | {"amx_bf16", "amx_int8"}
    assert library_caps(resolve(amx, "avx512_bf16")) == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}


def test_a_variable_the_environment_sets_is_left_as_it_is(monkeypatch):
    for name in _CAPS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")
    got = cap_libraries(resolve(_AVX512_BF16, "avx2"))
    assert got == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert {name: os.environ[name] for name in _CAPS} == got


_ENGINE = """
import json, sys, torch
from rtp_serve.engine import LLM, SamplingParams
llm = LLM(sys.argv[1], num_kv_blocks=16)
out = llm.generate([[5, 9, 14, 3, 22, 7]], SamplingParams(max_tokens=8, temperature=0.0))
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(),
                  "isa": llm.engine.runner.cpu_isa, "tokens": out[0].token_ids}))
"""


def _engine_in_a_fresh_process(model: Path, **env: str) -> tuple[dict, str]:
    environ = {k: v for k, v in os.environ.items() if k not in _CAPS} | {"ONEDNN_VERBOSE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _ENGINE, str(model)],
        env=environ | env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout + out.stderr


@above_avx2
def test_an_engine_forced_to_avx2_runs_torch_and_onednn_at_avx2_with_hfs_text(model_dir, hf_model):
    import torch

    model = model_dir("tiny-llama")
    got, logs = _engine_in_a_fresh_process(model, RTP_SERVE_ISA="avx2")
    assert got["aten"] == "AVX2"
    assert "capped from" in got["isa"]
    assert "isa:Intel AVX2" in logs  # oneDNN's own word for the code it dispatches
    assert "isa:Intel AVX-512" not in logs
    hf = hf_model("tiny-llama")
    prompt = torch.tensor([[5, 9, 14, 3, 22, 7]])
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=8, do_sample=False)[0, 6:].tolist()
    assert got["tokens"] == ref
    uncapped, logs = _engine_in_a_fresh_process(model)
    assert uncapped["aten"] != "AVX2" and "isa:Intel AVX2" not in logs


_VLLM_VIEW = """
import json, torch.cpu
names = ("_is_avx2_supported", "_is_avx512_supported", "_is_avx512_bf16_supported",
         "_is_amx_tile_supported")
print(json.dumps({n: getattr(torch.cpu, n)() for n in names}))
"""


def _cpu_as_seen(env: dict[str, str]) -> dict[str, bool]:
    out = subprocess.run(
        [sys.executable, "-c", _VLLM_VIEW], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


@above_avx2
def test_vllms_processes_see_the_capped_cpu(monkeypatch, tmp_path):
    """What vLLM's kernel choice reads (torch.cpu's checks), in a process started with the
    environment bench/serve.py gives vLLM; checked with this venv's torch, as vLLM's own
    venv is not part of the test install."""
    monkeypatch.delenv("RTP_SERVE_ISA", raising=False)
    for name in _CAPS:
        monkeypatch.delenv(name, raising=False)
    plain = vllm_env(tmp_path, kv_cache_gib=1)
    assert not set(_CAPS) & set(plain) and "isa_cap" not in plain.get("PYTHONPATH", "")
    hardware = _cpu_as_seen(plain)
    assert hardware["_is_avx512_supported"]

    monkeypatch.setenv("RTP_SERVE_ISA", "avx2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")  # set by the user: it wins
    capped = vllm_env(tmp_path, kv_cache_gib=1)
    assert capped["ATEN_CPU_CAPABILITY"] == "avx2" and capped["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert capped["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    assert capped["VLLM_CPU_KVCACHE_SPACE"] == "1"
    seen = _cpu_as_seen(capped)
    assert seen == {
        "_is_avx2_supported": True,
        "_is_avx512_supported": False,
        "_is_avx512_bf16_supported": False,
        "_is_amx_tile_supported": False,
    }
