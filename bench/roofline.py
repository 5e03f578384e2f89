"""The machine's ceilings, and the floor they put under a workload: what no engine on this
CPU can beat, beside which the benches print what each engine did.

Ceilings, measured in the run that uses them (`measure_machine`):
  GEMM peak       FLOP/s of a prefill-sized projection (2048 x 768 x 4096) through the
                  engine's fastest large-batch path (oneDNN, MKL or packed_gemm)
  read bandwidth  bytes/s that a reduction over a large tensor reads on the process's
                  threads: the ceiling of a decode step, which streams its weights and KV
                  and writes next to nothing
  copy bandwidth  bytes/s moved (read + write) by a large copy: reads and writes
                  counted together, so not the ceiling of a read stream
Both bandwidths drift on a shared host: a sum over 256 MiB buffers read 27-35 GB/s for
minutes on the Zen 4 VM of docs/benchmarks.md, and 50-66 in quieter spells. A floor is as
good as the ceilings measured for it: compare shares within one run.

A served load's floor (`served_floor`), for requests of prompt p and output o tokens:
  prefill  every prompt token's projections (2 FLOPs a parameter), its causal attention
           (QK and PV: 4 x layers x heads x head_dim FLOPs a query-key pair, p(p+1)/2
           pairs), one LM-head row a prompt: at the GEMM peak
  decode   each of the o - 1 later tokens' projections and LM head, its attention over its
           context (p + 1 ... p + o - 1 keys): at the GEMM peak; and the bytes its steps
           read (each token's context of K and V once, every weight once a step of
           `concurrency` streams): at the read bandwidth
`roofline_s` overlaps the decode's compute and reads (the larger of the two): at these
ceilings, no engine goes faster. `serial_s` runs them one after the other, as a decode step does here (its
GEMMs at the peak, then its attention at the read bandwidth: docs/engine.md), an estimate
rather than a bound: decode tokens that ride in a prefill step read no weights of their
own. Neither counts norms, RoPE, sampling or a step's own overhead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rtp_serve.core.model_config import ModelConfig
from rtp_serve.kernels.linear import cpu_kernels, make_linear


@dataclass(frozen=True, slots=True)
class Machine:
    bandwidth: float  # bytes/s moved by a copy (read + write)
    read_bandwidth: float  # bytes/s read by a reduction
    fp32_peak: float  # FLOP/s
    bf16_peak: float
    w8a8_peak: float  # integer ops/s of the W8A8 projection (activation quantization included)

    def peak(self, dtype: str) -> float:
        return self.bf16_peak if dtype == "bfloat16" else self.fp32_peak


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


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes per second read by a sum over a tensor far larger than the caches (the best
    of `reps`: on a shared machine the best run is the closest to what it can do)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    src.sum()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def gemm_peak(
    dtype: torch.dtype,
    m: int = 2048,
    k: int = 768,
    n: int = 4096,
    weight_dtype: str = "auto",
    reps: int = 20,
) -> float:
    """FLOP/s of a prefill-sized projection through the fastest of the engine's own paths
    for large batches (every path of the op but rows_gemm, built for a few rows; the best
    of `reps` each)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(dtype)
    op = make_linear(w, dtype, weight_dtype, cpu_kernels(torch.device("cpu")))
    x = torch.randn(m, k, generator=g).to(dtype)
    paths = op.paths() if hasattr(op, "paths") else {"op": op}
    best = float("inf")
    for name, path in paths.items():
        if name == "rows_gemm" and len(paths) > 1:
            continue
        path(x)
        for _ in range(reps):
            t = time.perf_counter()
            path(x)
            best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best


def measure_machine(
    dtypes: Sequence[str] = ("float32", "bfloat16", "w8a8"), reps: int = 20
) -> Machine:
    """The ceilings; a peak not asked for in `dtypes` is NaN (each takes seconds)."""

    def peak(name: str, dtype: torch.dtype, weight_dtype: str = "auto") -> float:
        if name not in dtypes:
            return math.nan
        return gemm_peak(dtype, weight_dtype=weight_dtype, reps=reps)

    return Machine(
        copy_bandwidth(),
        read_bandwidth(),
        peak("float32", torch.float32),
        peak("bfloat16", torch.bfloat16),
        peak("w8a8", torch.float32, "w8a8"),
    )


def projection_params(cfg: ModelConfig) -> int:
    """Weights a token multiplies in the decoder layers: q, k, v, o, gate, up and down."""
    h, d = cfg.hidden_size, cfg.head_dim
    attention = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    return cfg.num_layers * (attention + 3 * h * cfg.intermediate_size)


def head_params(cfg: ModelConfig) -> int:
    return cfg.hidden_size * cfg.vocab_size


def attention_flops_per_pair(cfg: ModelConfig) -> int:
    """One query against one key, every layer and head: QK and PV, a multiply-add each."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim


@dataclass(frozen=True, slots=True)
class Floor:
    dtype: str
    requests: int
    prompt_tokens: int
    decode_tokens: int  # output tokens after each request's first
    prefill_flops: float
    decode_flops: float
    kv_bytes: float  # read by the decode steps' attention
    weight_bytes: float  # read by the decode steps' projections
    peak: float  # FLOP/s
    read_bandwidth: float  # bytes/s

    @property
    def prefill_s(self) -> float:
        return self.prefill_flops / self.peak

    @property
    def decode_compute_s(self) -> float:
        return self.decode_flops / self.peak

    @property
    def decode_read_s(self) -> float:
        return (self.kv_bytes + self.weight_bytes) / self.read_bandwidth

    @property
    def roofline_s(self) -> float:
        return self.prefill_s + max(self.decode_compute_s, self.decode_read_s)

    @property
    def serial_s(self) -> float:
        return self.prefill_s + self.decode_compute_s + self.decode_read_s

    def describe(self) -> str:
        return (
            f"{self.requests} requests, {self.prompt_tokens:,} prompt + {self.decode_tokens:,} "
            f"decode tokens: prefill {self.prefill_flops / 1e12:.2f} TFLOP = "
            f"{self.prefill_s:.1f} s at the GEMM peak {self.peak / 1e9:.0f} GFLOPS; decode "
            f"{self.decode_flops / 1e12:.2f} TFLOP = {self.decode_compute_s:.1f} s, reads "
            f"{(self.kv_bytes + self.weight_bytes) / 1e9:.0f} GB (KV {self.kv_bytes / 1e9:.0f}, "
            f"weights {self.weight_bytes / 1e9:.0f}) = {self.decode_read_s:.1f} s at "
            f"{self.read_bandwidth / 1e9:.1f} GB/s -> roofline {self.roofline_s:.1f} s, "
            f"serial estimate {self.serial_s:.1f} s"
        )


def served_floor(
    cfg: ModelConfig,
    lens: Sequence[tuple[int, int]],
    concurrency: int | None,
    machine: Machine,
    dtype: str = "float32",
) -> Floor:
    """The floor of serving requests of (prompt, output) tokens `lens`, at most
    `concurrency` at a time (None: all at once), in `dtype` (its KV cache too)."""
    item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    params, head = projection_params(cfg), head_params(cfg)
    pair = attention_flops_per_pair(cfg)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * item
    prefill = sum(2 * params * p + pair * p * (p + 1) // 2 + 2 * head for p, _ in lens)
    decode_tokens = sum(max(o - 1, 0) for _, o in lens)
    # Keys the later tokens attend: p + 1, ..., p + o - 1.
    context = sum((o - 1) * p + (o - 1) * o // 2 for p, o in lens if o > 1)
    streams = max(1, min(concurrency or len(lens), len(lens)))
    steps = math.ceil(decode_tokens / streams)
    return Floor(
        dtype=dtype,
        requests=len(lens),
        prompt_tokens=sum(p for p, _ in lens),
        decode_tokens=decode_tokens,
        prefill_flops=float(prefill),
        decode_flops=float(2 * (params + head) * decode_tokens + pair * context),
        kv_bytes=float(kv_per_token * context),
        weight_bytes=float((params + head) * item * steps),
        peak=machine.peak(dtype),
        read_bandwidth=machine.read_bandwidth,
    )
