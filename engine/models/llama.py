"""Llama / Qwen2 / Mistral decoder over a paged KV cache, as plain functions over tensors.

The three families differ only in config (qkv bias, tied embeddings, rope scaling), so one
implementation serves all of them. q/k/v and gate/up projections are fused into one matmul
each at load time: fewer, larger kernels are what a CPU (and a GPU at batch 1) wants.

Each projection is a `LinearOp` (rtp_serve/kernels/linear.py), prepared once at load for its storage
(float32, bf16, or weight-only INT8) and the CPU; the model only calls it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rtp_serve.core.dtypes import INT8_WEIGHT_DTYPES
from rtp_serve.core.model_config import ModelConfig, RopeScaling
from rtp_serve.engine.lora.batch import LoraBatch
from rtp_serve.engine.lora.weights import DOWN, GATE_UP, OUT, QKV
from rtp_serve.engine.weights import back_to_back, joined
from rtp_serve.kernels.attention import AttentionBackend, AttentionMetadata, LayerCache
from rtp_serve.kernels.linear import Kernels, LinearOp, PartsLinear, RowsLinear, make_linear


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: LinearOp  # hidden -> (Hq + 2 Hkv) * D
    qkv_bias: torch.Tensor | None
    o: LinearOp
    post_norm: torch.Tensor
    gate_up: LinearOp  # hidden -> 2 * intermediate
    down: LinearOp


@dataclass(slots=True)
class LlamaWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: LinearOp  # reads the [vocab, hidden] embedding in place when tied

    def projections(self) -> Iterator[LinearOp]:
        """Every projection a decode step runs: those of each layer, then the LM head."""
        for layer in self.layers:
            yield from (layer.qkv, layer.o, layer.gate_up, layer.down)
        yield self.lm_head

    @property
    def nbytes_per_token(self) -> int:
        """Weight bytes a decode step reads (all projections and the head, not the embedding)."""
        return sum(op.nbytes for op in self.projections())


def fused_groups(cfg: ModelConfig) -> list[tuple[str, ...]]:
    """The checkpoint tensors each layer fuses into one projection, in their fused order
    (for the loader to place back to back: engine/weights.py)."""
    groups = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        groups.append(tuple(p + f"self_attn.{n}_proj.weight" for n in "qkv"))
        groups.append((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"))
    return groups


def load_llama_weights(
    tensors: dict[str, torch.Tensor],
    cfg: ModelConfig,
    dtype: torch.dtype,
    kernels: Kernels,
    weight_dtype: str = "auto",
    threads: int = 1,
) -> LlamaWeights:
    """Map HF tensor names onto fused weights; `tensors` is consumed (popped) as we go.

    `weight_dtype` "int8" (and "w8a8") stores the projections (not the embedding, norms or
    LM head, as is usual for weight-only INT8) quantized per output channel; "auto" keeps
    `dtype`.
    The projections are prepared (converted, quantized, prepacked; joined where the file
    does not hold a fused group back to back) by `threads` threads: torch's copies do it on
    one core each. A weight already in its dtype and layout is used as loaded.
    """

    def raw(name: str) -> torch.Tensor:
        try:
            return tensors.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint is missing tensor {name!r}") from None

    def take(name: str) -> torch.Tensor:
        return raw(name).to(dtype).contiguous()

    def proj(parts: list[torch.Tensor], quantize: bool = True) -> LinearOp:
        """[out, in] checkpoint weights, concatenated on `out`, as one projection. INT8 is
        quantized from the checkpoint's own values, not from a rounded copy. Parts already
        in `dtype` that do not lie back to back run apart (PartsLinear), not copied."""
        wd = weight_dtype if quantize else "auto"
        apart = len(parts) > 1 and back_to_back(parts) is None
        if apart and wd == "auto" and all(p.dtype == dtype for p in parts):
            ops = [make_linear(p, dtype, wd, kernels) for p in parts]
            return PartsLinear(ops, [p.shape[0] for p in parts])
        w = joined(parts)  # no copy where the loader placed them back to back
        return make_linear(w if wd in INT8_WEIGHT_DTYPES else w.to(dtype), dtype, wd, kernels)

    # Each job takes its weights from `tensors` as it starts, so a checkpoint is never held
    # twice (raw and prepared) beyond the projections in flight.
    jobs: list[tuple[int, str, list[str]]] = []  # layer, field, checkpoint names
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        jobs += [
            (i, "qkv", [p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
            (i, "o", [p + "self_attn.o_proj.weight"]),
            (i, "gate_up", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            (i, "down", [p + "mlp.down_proj.weight"]),
        ]
    if not cfg.tie_word_embeddings:
        jobs.append((-1, "lm_head", ["lm_head.weight"]))
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="weights") as pool:
        done = pool.map(lambda j: proj([raw(n) for n in j[2]], j[1] != "lm_head"), jobs)
        ops = dict(zip([j[:2] for j in jobs], done, strict=True))
    embed = take("model.embed_tokens.weight")
    # A tied head reuses the embedding as is: a transposed copy would double its memory.
    tied = cfg.tie_word_embeddings
    lm_head = RowsLinear(embed, dtype, kernels) if tied else ops[-1, "lm_head"]
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        bias = (
            torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            if cfg.attention_bias
            else None
        )
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=ops[i, "qkv"],
                qkv_bias=bias,
                o=ops[i, "o"],
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=ops[i, "gate_up"],
                down=ops[i, "down"],
            )
        )
    weights = LlamaWeights(
        embed=embed,
        layers=layers,
        norm=take("model.norm.weight"),
        lm_head=lm_head,
    )
    tensors.pop("lm_head.weight", None)  # some tied checkpoints store it anyway
    leftover = [n for n in tensors if not n.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"checkpoint has tensors this model does not use: {leftover[:5]}")
    return weights


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: leave high frequencies, divide low ones by `factor`, interpolate between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cache(
    cfg: ModelConfig, max_len: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_len, head_dim] in the rotate-half layout HF uses."""
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op; same math as below
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Lower precision: normalise in float32, scale in the model dtype, exactly as HF does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: silu(gate) * up of the fused gate_up output [T, 2 I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# A prefill chunk's MLP runs in slices of rows whose gate_up output stays under this size.
# Larger intermediates come from fresh mappings that fault page by page (glibc maps blocks
# from 32 MiB; services/common/heap.py) and spill the caches between gate_up and down: a
# 2048-row step of llama-100m spent 1.19 s in its 12 MLPs whole, 1.09 s in slices of 1024
# rows (16 MiB; 512 and 256 rows: 1.10-1.15 s).
MLP_SLICE_BYTES = 16 << 20


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: LlamaWeights,
        attention: AttentionBackend,
        max_len: int,
        norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm,
        rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = apply_rope,
        act: Callable[[torch.Tensor], torch.Tensor] = silu_mul,
    ) -> None:
        self.cfg = cfg
        self.w = weights
        self.attention = attention
        self.norm = norm  # the compiled kernel on CPUs (same rounding), else rms_norm
        self.rope = rope  # the compiled or Triton kernel (same rounding), else apply_rope
        self.act = act  # the compiled kernel on CPUs (one pass), else silu_mul
        self.cos, self.sin = rope_cache(cfg, max_len, weights.embed.dtype, weights.embed.device)
        self._q = cfg.num_heads * cfg.head_dim
        self._kv = cfg.num_kv_heads * cfg.head_dim
        self._heads = cfg.num_heads + cfg.num_kv_heads
        self._gate_up_row_bytes = 2 * cfg.intermediate_size * weights.embed.element_size()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerCache],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Run new tokens [T]; return float32 logits of the rows in `logits_indices`.
        `lora`: the rows' adapters, whose updates are added after each base projection."""
        cfg = self.cfg
        d = cfg.head_dim
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x = self.w.embed[input_ids]
        for i, (layer, cache) in enumerate(zip(self.w.layers, kv_caches, strict=True)):
            h = self.norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(h, layer.qkv_bias)
            if lora is not None:
                lora.add(i, QKV, h, qkv)
            # RoPE on q and k together: one set of elementwise ops instead of two.
            qk = self.rope(qkv[:, : self._q + self._kv].view(-1, self._heads, d), cos, sin)
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
            v = qkv[:, self._q + self._kv :].view(-1, cfg.num_kv_heads, d)
            attn = self.attention.forward(q, k, v, cache, meta).view(-1, self._q)
            x = layer.o(attn, None, x)  # residual fused into the GEMM
            if lora is not None:
                lora.add(i, OUT, attn, x)
            x = self._mlp(i, layer, x, lora)
        x = self.norm(x[logits_indices], self.w.norm, cfg.rms_norm_eps)
        return self.w.lm_head(x).float()

    def _mlp(self, i: int, layer: LayerWeights, x: torch.Tensor, lora: LoraBatch | None):
        """The MLP block with its residual. A large prefill chunk runs it in even slices of
        rows whose gate_up output fits MLP_SLICE_BYTES (a LoRA batch, whose adapters are
        laid out over the step's rows, runs whole)."""
        slices = math.ceil(x.shape[0] * self._gate_up_row_bytes / MLP_SLICE_BYTES)
        if slices <= 1 or lora is not None:
            return self._mlp_rows(i, layer, x, lora)
        out = torch.empty_like(x)
        rows = math.ceil(x.shape[0] / slices)
        for s in range(0, x.shape[0], rows):
            out[s : s + rows] = self._mlp_rows(i, layer, x[s : s + rows], None)
        return out

    def _mlp_rows(self, i: int, layer: LayerWeights, x: torch.Tensor, lora: LoraBatch | None):
        h = self.norm(x, layer.post_norm, self.cfg.rms_norm_eps)
        gate_up = layer.gate_up(h)
        if lora is not None:
            lora.add(i, GATE_UP, h, gate_up)
        act = self.act(gate_up)
        out = layer.down(act, None, x)
        if lora is not None:
            lora.add(i, DOWN, act, out)
        return out
