"""Engine benchmark: this engine vs HF transformers on the same workload, in one run.

    python bench/engine.py [--models llama-100m,smollm2-135m] [--dtypes float32,bfloat16]
                           [--threads 2] [--quick]

(a) one request, 256-token prompt, 128 new tokens: time to first token, decode tokens/s,
    and decode against the memory-bandwidth roofline (weight bytes per token over the
    bandwidth of a large tensor copy measured in this run);
(b) 64 requests of 256-token prompts, 128 new tokens each, submitted together: output
    tokens/s, against HF's best static-batch throughput on the same prompts.
Each model (a preset name or a checkpoint directory) is measured in turn; prints a table
with ratios (ours / HF). Timings are wall-clock on a shared machine: compare
ratios within one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# `engine` package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.make_model import resolve_model  # noqa: E402


@dataclass
class Single:
    ttft_s: float
    decode_tok_s: float


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes per second moved (read + write) by a large tensor copy."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


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


def bench_model(model_dir: str, args: argparse.Namespace, bw: float) -> list[tuple]:
    """Rows (model, dtype, metric, ours, HF) for one model, every dtype."""
    name = Path(model_dir).name
    rows: list[tuple[str, str, str, float, float]] = []
    for dtype in args.dtypes.split(","):
        tdtype = getattr(torch, dtype)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype).eval()
        vocab = hf.config.vocab_size
        single = prompts(1, args.prompt_len, vocab, seed=1)[0]
        batch = prompts(args.batch, args.prompt_len, vocab, seed=2)
        # Every weight but the embedding table is read once per decoded token; a tied
        # embedding is read in full as the LM head.
        weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
        if not hf.config.tie_word_embeddings:
            embed = hf.model.embed_tokens.weight
            weight_bytes -= embed.numel() * embed.element_size()
        roofline = bw / weight_bytes

        kv_bytes = 3 << 30
        llm = LLM(
            model_dir,
            dtype=dtype,
            num_threads=args.threads,
            kv_cache_memory_bytes=kv_bytes,
            max_num_seqs=max(64, args.batch),
        )
        with torch.inference_mode():
            hf_single(hf, single[:32], 4)  # warm-up
            ours_single(llm, single[:32], 4)
            a_hf = hf_single(hf, single, args.new_tokens)
            a_us = ours_single(llm, single, args.new_tokens)
            hf_best, hf_bs = 0.0, 0
            for bs in map(int, args.hf_batch_sizes.split(",")):
                tput = hf_batch(hf, batch, args.new_tokens, bs)
                if tput > hf_best:
                    hf_best, hf_bs = tput, bs
            b_us = ours_batch(llm, batch, args.new_tokens)
        rows += [
            (name, dtype, "(a) TTFT ms (lower is better)", a_us.ttft_s * 1e3, a_hf.ttft_s * 1e3),
            (name, dtype, "(a) decode tok/s", a_us.decode_tok_s, a_hf.decode_tok_s),
            (name, dtype, "(a) decode roofline tok/s", roofline, roofline),
            (name, dtype, f"(b) {args.batch}x throughput tok/s (HF bs={hf_bs})", b_us, hf_best),
        ]
        print(
            f"{name} {dtype}: ours decode = {a_us.decode_tok_s / roofline:.0%} of roofline "
            f"({roofline:.1f} tok/s at {weight_bytes / 2**20:.0f} MiB/token)"
        )
        for row in rows[-4:]:
            _print_row(*row)
        del hf, llm
        gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="a model dir or preset (default: llama-100m)")
    ap.add_argument(
        "--models", default=None, help="several, comma-separated (llama-100m,smollm2-135m)"
    )
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hf-batch-sizes", default="16,64", help="HF static batch sizes to try")
    ap.add_argument("--quick", action="store_true", help="8 requests, 32 new tokens (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.new_tokens, args.hf_batch_sizes = 8, 32, "8"
    if args.model and args.models:
        ap.error("give --model or --models, not both")
    torch.set_num_threads(args.threads)
    names = (args.models or args.model or "llama-100m").split(",")
    model_dirs = [str(resolve_model(n)) for n in names]

    bw = copy_bandwidth()
    print(
        f"models {', '.join(model_dirs)}, threads {args.threads}, copy bandwidth {bw / 1e9:.1f} GB/s"
    )
    rows = [row for d in model_dirs for row in bench_model(d, args, bw)]

    print()
    print(f"{'model':18} {'dtype':9} {'metric':44} {'ours':>10} {'HF':>10} {'ours/HF':>8}")
    for row in rows:
        _print_row(*row)


def _print_row(model: str, dtype: str, metric: str, ours: float, ref: float) -> None:
    print(
        f"{model:18} {dtype:9} {metric:44} {ours:10.1f} {ref:10.1f} {ours / ref:8.2f}", flush=True
    )


if __name__ == "__main__":
    main()
