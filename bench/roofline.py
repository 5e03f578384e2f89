"""The machine's ceilings, and the floor they put under a workload: what no engine on this
CPU can beat, beside which the benches print what each engine did.

The ceilings (`Machine`) are measured by bench/ceilings.py: in this process, or with
`measure_apart` in a process of its own, for a bench whose process runs an engine (a torch
parallel region here would start a second OpenMP team beside the engine's, which slows
every region of its steps: docs/engine.md, threads).

A served load's floor (`served_floor`), for requests of prompt p and output o tokens:
  prefill  every prompt token's projections (2 FLOPs a parameter), its causal attention
           (QK and PV: 4 x layers x heads x head_dim FLOPs a query-key pair, p(p+1)/2
           pairs), one LM-head row a prompt: at the GEMM peak
  decode   each of the o - 1 later tokens' projections and LM head, its attention over its
           context (p + 1 ... p + o - 1 keys): at the GEMM peak; and the bytes its steps
           read (each token's context of K and V once, every weight once a step of
           `concurrency` streams): at the read bandwidth
`roofline_s` overlaps all of the decode's compute with all of its reads (the larger of
the two): at these ceilings no engine goes faster. `serial_s` runs a decode step as this
engine and vLLM-CPU do: its projections (each as long as the larger of its FLOPs and its
weights' reads), then its attention (the larger of its FLOPs and its KV reads), one after
the other (docs/engine.md: the two overlapped on two threads gained nothing here). Decode
tokens that ride in a prefill step read no weights of their own, so a mixed load can beat
`serial_s` by a little. Neither counts norms, RoPE, sampling or a step's own overhead.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

from bench.linear import shapes
from rtp_serve.core.model_config import ModelConfig
from rtp_serve.engine.memory import ITEMSIZE, kv_bytes_per_token


@dataclass(frozen=True, slots=True)
class Machine:
    bandwidth: float  # bytes/s moved by a copy (read + write)
    read_bandwidth: float  # bytes/s read by a reduction
    fp32_peak: float  # FLOP/s
    bf16_peak: float
    w8a8_peak: float  # integer ops/s of the W8A8 projection (activation quantization included)

    def peak(self, dtype: str) -> float:
        return self.bf16_peak if dtype == "bfloat16" else self.fp32_peak

    def best(self, other: Machine) -> Machine:
        """Each ceiling the higher of two measurements (NaN: not measured): the host
        drifts, and a floor must not lie above what an engine reached between them."""
        return Machine(*map(_higher, astuple(self), astuple(other)))


def _higher(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


def measure_apart(dtypes: Sequence[str] = ("float32",)) -> Machine:
    """bench/ceilings.py's measurement, run in a Python process of its own."""
    script = Path(__file__).with_name("ceilings.py")
    out = subprocess.run(
        [sys.executable, str(script), "--json", "--dtypes", ",".join(dtypes)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return Machine(**json.loads(out.stdout.strip().splitlines()[-1]))


def projection_params(cfg: ModelConfig) -> int:
    """Weights a token multiplies in the decoder layers: q, k, v, o, gate, up and down."""
    return cfg.num_layers * sum(k * n for k, n in shapes(cfg))


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
    decode_gemm_flops: float  # the decode tokens' projections and LM head
    decode_attention_flops: float
    weight_bytes: float  # read by the decode steps' projections
    kv_bytes: float  # read by the decode steps' attention
    peak: float  # FLOP/s
    read_bandwidth: float  # bytes/s

    @property
    def prefill_s(self) -> float:
        return self.prefill_flops / self.peak

    @property
    def decode_gemm_s(self) -> float:
        """The decode steps' projections, each streaming its weights as it computes."""
        return max(self.decode_gemm_flops / self.peak, self.weight_bytes / self.read_bandwidth)

    @property
    def decode_attention_s(self) -> float:
        return max(self.decode_attention_flops / self.peak, self.kv_bytes / self.read_bandwidth)

    @property
    def roofline_s(self) -> float:
        compute = (self.decode_gemm_flops + self.decode_attention_flops) / self.peak
        reads = (self.weight_bytes + self.kv_bytes) / self.read_bandwidth
        return self.prefill_s + max(compute, reads)

    @property
    def serial_s(self) -> float:
        return self.prefill_s + self.decode_gemm_s + self.decode_attention_s

    def describe(self) -> str:
        return (
            f"{self.requests} requests, {self.prompt_tokens:,} prompt + {self.decode_tokens:,} "
            f"decode tokens at {self.peak / 1e9:.0f} GFLOPS and {self.read_bandwidth / 1e9:.1f} "
            f"GB/s: prefill {self.prefill_flops / 1e12:.2f} TFLOP {self.prefill_s:.1f} s; decode "
            f"GEMMs {self.decode_gemm_flops / 1e12:.2f} TFLOP, weights "
            f"{self.weight_bytes / 1e9:.0f} GB {self.decode_gemm_s:.1f} s; decode attention "
            f"{self.decode_attention_flops / 1e12:.2f} TFLOP, KV {self.kv_bytes / 1e9:.0f} GB "
            f"{self.decode_attention_s:.1f} s -> roofline {self.roofline_s:.1f} s, serial "
            f"{self.serial_s:.1f} s"
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
    item = ITEMSIZE[dtype]
    params, head = projection_params(cfg), head_params(cfg)
    pair = attention_flops_per_pair(cfg)
    kv_per_token = kv_bytes_per_token(cfg, dtype)
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
        decode_gemm_flops=float(2 * (params + head) * decode_tokens),
        decode_attention_flops=float(pair * context),
        weight_bytes=float((params + head) * item * steps),
        kv_bytes=float(kv_per_token * context),
        peak=machine.peak(dtype),
        read_bandwidth=machine.read_bandwidth,
    )
