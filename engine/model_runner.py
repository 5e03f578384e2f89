"""Turns a scheduled step into tensors, runs the model on them and samples.

Owns the model weights and the KV cache tensors; knows nothing about queues or policy.
"""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig, EngineLimits, ModelConfig
from engine.dtypes import torch_dtype
from engine.memory import kv_bytes_per_token
from engine.models.llama import LlamaModel, load_llama_weights, rms_norm
from engine.outputs import SampledToken
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.weights import load_tensors
from kernels.attention import AttentionMetadata, PrefillChunk, get_attention_backend
from kernels.linear import cpu_kernels

log = logging.getLogger(__name__)


def resolve_limits(model: ModelConfig, config: EngineConfig) -> EngineLimits:
    bytes_per_block = config.block_size * kv_bytes_per_token(model, config.resolved_kv_dtype)
    num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // bytes_per_block)
    max_model_len = min(
        config.max_model_len or model.max_position_embeddings, model.max_position_embeddings
    )
    # A request can never hold more KV than the whole pool: past that it would wait (or be
    # preempted) forever, so the pool caps the context.
    capacity = num_blocks * config.block_size
    if max_model_len > capacity:
        log.warning(
            "max_model_len %d exceeds the KV pool (%d tokens); capping it", max_model_len, capacity
        )
        max_model_len = capacity
    return EngineLimits(
        num_kv_blocks=num_blocks, max_model_len=max_model_len, bytes_per_block=bytes_per_block
    )


class ModelRunner:
    def __init__(
        self, model_config: ModelConfig, config: EngineConfig, limits: EngineLimits
    ) -> None:
        self.cfg = model_config
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.kv_dtype = torch_dtype(config.resolved_kv_dtype)
        tensors = load_tensors(config.model, device=str(self.device))
        self.kernels = cpu_kernels(self.device)
        weights = load_llama_weights(
            tensors, model_config, self.dtype, self.kernels, config.weight_dtype
        )
        attention = get_attention_backend(self.device, model_config.head_dim**-0.5)
        norm = getattr(self.kernels.ops, "rms_norm", rms_norm)
        self.model = LlamaModel(model_config, weights, attention, limits.max_model_len, norm)
        slots = limits.num_kv_blocks * config.block_size
        shape = (
            model_config.num_layers,
            2,
            slots,
            model_config.num_kv_heads,
            model_config.head_dim,
        )
        # Zeroed up front, like a GPU pool reserved at start-up: first-touch page faults would
        # otherwise land on the first requests' steps.
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.sampler = Sampler(model_config.eos_token_ids, config.seed)
        isa = self.kernels.isa
        self.cpu_isa = isa.describe() if isa else self.device.type
        self.linear_kernels = weights.layers[0].qkv.kernel + (
            " + oneDNN prepacked bf16" if self.kernels.prepack_bf16 else ""
        )
        log.info(
            "model loaded: %s, %d layers, %s (weights %s, %.0f MiB read per step), "
            "cpu: %s; linear kernels: %s; kv cache %s, %d blocks = %d tokens (%.1f MiB)",
            model_config.architecture,
            model_config.num_layers,
            config.dtype,
            config.weight_dtype,
            weights.nbytes_per_token / 2**20,
            self.cpu_isa,
            self.linear_kernels,
            config.resolved_kv_dtype,
            limits.num_kv_blocks,
            limits.num_kv_blocks * config.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
        )

    # -- KV in and out (PD transfer, remote tiers) ------------------------------------------
    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        table = torch.tensor(block_ids, dtype=torch.int64)
        pos = torch.arange(start, end)
        return (table[pos // bs] * bs + pos % bs).to(self.device)

    def read_kv(
        self, block_ids: list[int], start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of token positions [start, end), each [layers, end - start, kv_heads, D]."""
        slots = self._slots(block_ids, start, end)
        return self.kv_cache[:, 0].index_select(1, slots), self.kv_cache[:, 1].index_select(
            1, slots
        )

    def write_kv(self, block_ids: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        expected = (self.cfg.num_layers, k.shape[1], self.cfg.num_kv_heads, self.cfg.head_dim)
        if tuple(k.shape) != expected or k.shape != v.shape:
            raise ValueError(f"KV shape {tuple(k.shape)}/{tuple(v.shape)} != expected {expected}")
        slots = self._slots(block_ids, start, start + k.shape[1])
        self.kv_cache[:, 0].index_copy_(1, slots, k.to(self.kv_dtype))
        self.kv_cache[:, 1].index_copy_(1, slots, v.to(self.kv_dtype))

    def execute(
        self, out: SchedulerOutput, block_tables: dict[str, list[int]]
    ) -> dict[str, SampledToken]:
        if not out.scheduled:
            return {}
        # Decodes (one new token) first, so attention can batch them in one call.
        items = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, meta, sample_rows = self._prepare(items, block_tables)
        samplers = [s.request for s in items if s.samples]
        if not samplers:
            no_rows = torch.tensor([0], device=self.device)
            self.model.forward(input_ids, positions, self.kv_caches, meta, no_rows)
            return {}
        logits = self.model.forward(input_ids, positions, self.kv_caches, meta, sample_rows)
        tokens = self.sampler(logits, samplers)
        return {r.request_id: t for r, t in zip(samplers, tokens, strict=True)}

    def _prepare(
        self, items: list[ScheduledRequest], block_tables: dict[str, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_mapping: list[int] = []
        sample_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for item in items:
            r: Request = item.request
            start, n = r.num_computed_tokens, item.num_new_tokens
            table = block_tables[r.request_id]
            q_start = len(ids)
            ids.extend(r.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if item.samples:
                sample_rows.append(q_start + n - 1)
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                ctx_slots = None
                if start:
                    t = torch.tensor(table[: (start + n + bs - 1) // bs])
                    ctx_slots = (t[:, None] * bs + torch.arange(bs)).flatten()[: start + n]
                    ctx_slots = ctx_slots.to(self.device)
                prefills.append(PrefillChunk(q_start, n, start, ctx_slots))

        decode_tables_t = decode_lens_t = None
        if decode_tables:
            nblk = max(map(len, decode_tables))
            padded = [t + [0] * (nblk - len(t)) for t in decode_tables]
            decode_tables_t = torch.tensor(padded, device=self.device)
            decode_lens_t = torch.tensor(decode_lens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, device=self.device),
            block_size=bs,
            num_decodes=len(decode_tables),
            decode_block_tables=decode_tables_t,
            decode_seq_lens=decode_lens_t,
            prefills=prefills,
        )
        dev = self.device
        return (
            torch.tensor(ids, device=dev),
            torch.tensor(pos, device=dev),
            meta,
            torch.tensor(sample_rows, device=dev),
        )
