"""Turns a scheduled step into tensors, runs the model on them and samples.

Owns the model weights and the KV cache tensors; knows nothing about queues or policy.
"""

from __future__ import annotations

import logging
import math

import torch

from rtp_serve.core.model_config import ModelConfig
from rtp_serve.core.outputs import SampledToken
from rtp_serve.engine import prefault
from rtp_serve.engine.config import EngineConfig, EngineLimits
from rtp_serve.engine.cuda_graphs import DecodeGraphs, cuda_capture
from rtp_serve.engine.dtypes import torch_dtype
from rtp_serve.engine.grammar_masks import MaskWorker
from rtp_serve.engine.lora.batch import LoraBatch, lora_ops
from rtp_serve.engine.lora.registry import LoraRegistry
from rtp_serve.engine.memory import kv_bytes_per_block
from rtp_serve.engine.models.llama import (
    LlamaModel,
    apply_rope,
    fused_groups,
    load_llama_weights,
    rms_norm,
    silu_mul,
)
from rtp_serve.engine.outputs import PromptKV
from rtp_serve.engine.request import Request
from rtp_serve.engine.sampler import Sampler
from rtp_serve.engine.scheduler import ScheduledRequest, SchedulerOutput
from rtp_serve.engine.spec_decode.rejection import DraftRow, accept, rows_of
from rtp_serve.engine.weights import load_tensors
from rtp_serve.kernels import backends, gemm_table
from rtp_serve.kernels.attention import AttentionMetadata, LayerCache, PrefillChunk
from rtp_serve.kernels.linear import cpu_kernels, tune_linears

log = logging.getLogger(__name__)


def resolve_limits(model: ModelConfig, config: EngineConfig) -> EngineLimits:
    bytes_per_block = kv_bytes_per_block(model, config.resolved_kv_dtype, config.block_size)
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


# A CPU pool this large is its own anonymous mapping (glibc serves allocations above its
# mmap threshold, at most 32 MiB, with mmap), which the kernel hands out zero-filled page
# by page on first touch: torch.empty reads as zeros without writing them. Writing them
# (torch.zeros) costs about 2 s a GiB here, so the "auto" pool of an idle 2-core box (11
# GiB) made a worker take 12 to 21 s to start, most of a scale-from-zero cold start; the
# first-touch cost instead lands on the requests that first use each block (a 270-token
# prompt's 17 blocks of smollm2: about 25 ms). Smaller pools, and device memory, are
# zeroed as before. `prefault_kv` maps a large pool's pages in the background instead, while
# the cores idle (engine/prefault.py).
_FRESH_MAPPING_BYTES = 64 << 20


def _kv_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type == "cpu" and nbytes >= _FRESH_MAPPING_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        limits: EngineLimits,
        truncated: bool = False,
    ) -> None:
        """`truncated`: the checkpoint has more layers than `model_config` (a draft made of
        its first layers); the others are not loaded."""
        self.cfg = model_config
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.kv_dtype = torch_dtype(config.resolved_kv_dtype)
        # First: where the ISA level is forced below the CPU's, loading the kernels caps
        # torch's libraries too, which must come before any torch op (isa.cap_libraries).
        self.kernels = cpu_kernels(self.device)
        fuse = fused_groups(model_config)  # read (a device) back to back: fused without a copy
        tensors = load_tensors(
            config.model, device=str(self.device), fuse=fuse, load_format=config.load_format
        )
        if truncated:
            tensors = _first_layers(tensors, model_config.num_layers)
        weights = load_llama_weights(
            tensors,
            model_config,
            self.dtype,
            self.kernels,
            config.weight_dtype,
            threads=torch.get_num_threads(),
        )
        tune_linears(weights.projections())  # each shape's kernel per row count, measured
        # From how many rows a step's projections run near their best per row (None: not
        # measured); the scheduler's prompt chunks under an ITL target go no smaller.
        self.efficient_rows = gemm_table.efficient_rows(
            getattr(op, "table", None)
            for layer in weights.layers
            for op in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        choice = backends.choose(self.device, self.dtype, self.kv_dtype, config.block_size)
        self.attention_backend = choice.describe()
        attention = backends.build(choice, model_config.head_dim**-0.5, self.device)
        norm = getattr(self.kernels.ops, "rms_norm", rms_norm)
        # One pass instead of torch's three to five, the same rounding; in float32 only: in
        # bf16 their scalar conversions took 2-4x torch's vectorized ops (AVX-512, 2 threads;
        # float32 at 2,048 rows: rope 1.3 vs 20 ms, silu_mul 1.2 vs 12 ms).
        fused = self.kernels.ops if self.dtype == torch.float32 else None
        rope = getattr(fused, "rope", apply_rope)
        act = getattr(fused, "silu_mul", silu_mul)
        if choice.name == "triton":  # its RMSNorm and rotary kernels come with it
            from rtp_serve.kernels.triton import rms_norm as triton_norm
            from rtp_serve.kernels.triton import rotary

            norm, rope = triton_norm.rms_norm, rotary.apply_rope
        self.model = LlamaModel(
            model_config, weights, attention, limits.max_model_len, norm, rope, act
        )
        self.weight_bytes_per_step = weights.nbytes_per_token  # what a decode step streams
        # CUDA graphs pad decode batches with rows that write into a scratch block past the
        # pool's (engine/cuda_graphs.py): the block pool never hands it out.
        graphs = (
            self.device.type == "cuda" and choice.name == "triton" and bool(config.cuda_graph_sizes)
        )
        pool_blocks = limits.num_kv_blocks + (1 if graphs else 0)
        slots = pool_blocks * config.block_size
        shape = (
            model_config.num_layers,
            2,
            slots,
            model_config.num_kv_heads,
            model_config.head_dim,
        )
        self.kv_cache = _kv_pool(shape, self.kv_dtype, self.device)
        fresh = self.device.type == "cpu" and self.kv_cache.nbytes >= _FRESH_MAPPING_BYTES
        # Set to stop mapping the pool ahead (close()); None where nothing maps it.
        self._prefault_stop = (
            prefault.start(self.kv_cache) if config.prefault_kv and fresh else None
        )
        # An int8 cache: a float32 scale per layer, K/V, block and kv head.
        self.kv_scales = None
        if self.kv_dtype == torch.int8:
            scales = (model_config.num_layers, 2, pool_blocks, model_config.num_kv_heads)
            self.kv_scales = torch.zeros(scales, dtype=torch.float32, device=self.device)
        self.kv_caches = [
            LayerCache(layer[0], layer[1])
            if self.kv_scales is None
            else LayerCache(layer[0], layer[1], self.kv_scales[i, 0], self.kv_scales[i, 1])
            for i, layer in enumerate(self.kv_cache)
        ]
        self.graphs: DecodeGraphs | None = None
        self.graph_steps = 0  # decode steps replayed from a graph
        if graphs:
            self.graphs = DecodeGraphs(
                self._forward,
                config.cuda_graph_sizes,
                max_blocks=-(-limits.max_model_len // config.block_size),
                scratch_block=limits.num_kv_blocks,
                block_size=config.block_size,
                device=self.device,
                capture=cuda_capture(self.device),
            )
            log.info("captured CUDA graphs for decode batches of %s", self.graphs.sizes)
        self.sampler = Sampler(model_config.eos_token_ids)
        self.masks = MaskWorker(model_config.vocab_size)
        self.loras = LoraRegistry(model_config, config.max_loras, self.dtype, self.device)
        self._lora_ops = lora_ops(self.kernels.ops, self.dtype)
        isa = self.kernels.isa
        self.cpu_isa = isa.describe() if isa else self.device.type
        # The first projection's kernel per row count, as measured (gemm_table.py).
        qkv = weights.layers[0].qkv
        table = getattr(qkv, "table", None)
        self.linear_kernels = (table.describe() if table is not None else qkv.kernel) + (
            " + oneDNN prepacked bf16" if self.kernels.prepack_bf16 else ""
        )
        log.info(
            "model loaded: %s, %d layers, %s (weights %s, %.0f MiB read per step), "
            "cpu: %s; linear kernels: %s (near their best per row from %s rows); attention: %s; "
            "kv cache %s, %d blocks = %d tokens (%.1f MiB)",
            model_config.architecture,
            model_config.num_layers,
            config.dtype,
            config.weight_dtype,
            weights.nbytes_per_token / 2**20,
            self.cpu_isa,
            self.linear_kernels,
            self.efficient_rows or "?",
            self.attention_backend,
            config.resolved_kv_dtype,
            limits.num_kv_blocks,
            limits.num_kv_blocks * config.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
        )

    def close(self) -> None:
        """Stop mapping the pool ahead, so that an engine shut down in a process that goes on
        leaves no thread making its pool resident."""
        if self._prefault_stop is not None:
            self._prefault_stop.set()

    # -- KV in and out (PD transfer, remote tiers) ------------------------------------------
    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        table = torch.tensor(block_ids, dtype=torch.int64)
        pos = torch.arange(start, end)
        return (table[pos // bs] * bs + pos % bs).to(self.device)

    def _blocks(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """The blocks holding positions [start, end), start a multiple of the block size."""
        if start % self.block_size:
            raise ValueError(f"int8 KV must start at a block boundary, not at {start}")
        first, last = start // self.block_size, -(-end // self.block_size)
        return torch.tensor(block_ids[first:last], dtype=torch.int64, device=self.device)

    def read_kv(self, block_ids: list[int], start: int, end: int) -> PromptKV:
        """KV of token positions [start, end) as stored: [layers, end - start, kv_heads, D]
        each, with the covered blocks' scales for an int8 cache."""
        # One gather over the whole (contiguous) pool, K and V together. index_select on a
        # K or V view (kv_cache[:, 0]) is not contiguous, and torch's CPU kernel then copies
        # the whole view first: 130 ms per 16-token block of a 64 MiB float32 pool, not 60 us.
        k, v = _split_kv(self.kv_cache.index_select(2, self._slots(block_ids, start, end)))
        if self.kv_scales is None:
            return PromptKV(start, k, v)
        k_scale, v_scale = _split_kv(
            self.kv_scales.index_select(2, self._blocks(block_ids, start, end))
        )
        return PromptKV(start, k, v, k_scale, v_scale)

    def write_kv(self, block_ids: list[int], kv: PromptKV) -> None:
        """Store KV read from another pool of this layout (read_kv) into these blocks."""
        cfg = self.cfg
        expected = (cfg.num_layers, kv.num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if tuple(kv.k.shape) != expected or kv.k.shape != kv.v.shape:
            raise ValueError(f"KV shape {tuple(kv.k.shape)}/{tuple(kv.v.shape)} != {expected}")
        if (kv.k.dtype == torch.int8) != (self.kv_scales is not None):
            raise ValueError(f"KV of {kv.k.dtype} cannot go into a {self.kv_dtype} cache")
        end = kv.start + kv.num_tokens
        slots = self._slots(block_ids, kv.start, end)
        if self.kv_scales is not None:
            blocks = self._blocks(block_ids, kv.start, end)
            scale_shape = (cfg.num_layers, len(blocks), cfg.num_kv_heads)
            if kv.k_scale is None or kv.v_scale is None:
                raise ValueError("int8 KV arrived without its scales")
            if tuple(kv.k_scale.shape) != scale_shape or kv.k_scale.shape != kv.v_scale.shape:
                raise ValueError(f"KV scales {tuple(kv.k_scale.shape)} != {scale_shape}")
            self.kv_scales[:, 0].index_copy_(1, blocks, kv.k_scale.float())
            self.kv_scales[:, 1].index_copy_(1, blocks, kv.v_scale.float())
        self.kv_cache[:, 0].index_copy_(1, slots, kv.k.to(self.kv_dtype))
        self.kv_cache[:, 1].index_copy_(1, slots, kv.v.to(self.kv_dtype))

    def execute(
        self, out: SchedulerOutput, block_tables: dict[str, list[int]]
    ) -> dict[str, list[SampledToken]]:
        """Per request that samples: its new tokens (with drafts, the accepted ones plus the
        target's next, engine/spec_decode/rejection.py; else the one sampled token)."""
        if not out.scheduled:
            return {}
        # Decodes (one new token) first, so attention can batch them in one call. A request
        # verifying drafts is decode rows too: one per token, each over the context before it.
        # Within each part rows are grouped by adapter (engine/lora/batch.py).
        items = sorted(out.scheduled, key=lambda s: (_is_prefill(s), s.request.lora))
        input_ids, positions, meta, sample_rows = self._prepare(items, block_tables)
        lora = self._lora_batch(items)
        samplers = [s for s in items if s.samples]
        if not samplers:
            no_rows = torch.tensor([0], device=self.device)
            self.model.forward(input_ids, positions, self.kv_caches, meta, no_rows, lora)
            return {}
        rows: list[Request | DraftRow] = []
        for s in samplers:
            rows.extend(rows_of(s.request, s.spec_token_ids))
        masks = self.masks.start(rows)  # grammar masks, beside the forward pass
        try:
            logits = None
            if self.graphs is not None and lora is None and len(sample_rows) == len(input_ids):
                logits = self.graphs.run(input_ids, positions, meta)  # None: no graph fits
                self.graph_steps += logits is not None
            if logits is None:
                logits = self._forward(input_ids, positions, meta, sample_rows, lora)
        except BaseException:
            if masks is not None:
                masks.biases()  # the worker is done with the matchers before anyone else
            raise
        tokens = self.sampler(logits, rows, masks)
        result: dict[str, list[SampledToken]] = {}
        i = 0
        for s in samplers:
            n = len(s.spec_token_ids) + 1
            result[s.request.request_id] = accept(s.spec_token_ids, tokens[i : i + n])
            i += n
        return result

    def _forward(self, input_ids, positions, meta, logits_rows, lora=None) -> torch.Tensor:
        return self.model.forward(input_ids, positions, self.kv_caches, meta, logits_rows, lora)

    def _lora_batch(self, items: list[ScheduledRequest]) -> LoraBatch | None:
        names = {s.request.lora for s in items if s.request.lora}
        if not names:
            return None
        resident = self.loras.activate(names)
        rows = [(s.num_new_tokens, s.request.lora, _is_prefill(s)) for s in items]
        return LoraBatch.of_rows(rows, resident, self.loras.stacked, self.dtype, self._lora_ops)

    def _prepare(
        self, items: list[ScheduledRequest], block_tables: dict[str, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        ids: list[int] = []
        # Decodes (first) are one token each; a prefill chunk's positions and slots are
        # computed as tensors, never token by token.
        decode_pos: list[int] = []
        decode_slots: list[int] = []
        chunk_pos: list[torch.Tensor] = []
        chunk_slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        decode_tables: list[list[int]] = []
        prefills: list[PrefillChunk] = []
        for item in items:
            r: Request = item.request
            start, n = r.num_computed_tokens, item.num_new_tokens
            table = block_tables[r.request_id]
            q_start = len(ids)
            ids.extend(r.token_ids[start : start + n])
            ids.extend(item.spec_token_ids)  # after the request's own tokens, if any
            if item.samples:
                # Verifying k drafts samples k + 1 rows: after each prefix of the drafts.
                k = len(item.spec_token_ids)
                sample_rows.extend(range(q_start + n - 1 - k, q_start + n))
            if not _is_prefill(item):
                # Row j sees positions 0 .. start + j: its own K/V and that of the rows
                # before it are written before any row attends (rtp_serve/kernels/attention.py).
                for pos in range(start, start + n):
                    decode_pos.append(pos)
                    decode_slots.append(table[pos // bs] * bs + pos % bs)
                    decode_tables.append(table)
            else:
                blocks = torch.tensor(table[: -(-(start + n) // bs)])
                p = torch.arange(start, start + n)
                chunk_pos.append(p)
                chunk_slots.append(blocks[p // bs] * bs + p % bs)
                prefills.append(PrefillChunk(q_start, n, start, blocks.to(self.device)))

        decode_tables_t = decode_lens_t = None
        if decode_tables:
            nblk = max(map(len, decode_tables))
            padded = [t + [0] * (nblk - len(t)) for t in decode_tables]
            decode_tables_t = torch.tensor(padded, device=self.device)
            decode_lens_t = torch.tensor(decode_pos, device=self.device) + 1
        dev = self.device
        positions = torch.cat([torch.tensor(decode_pos, dtype=torch.int64), *chunk_pos])
        slot_mapping = torch.cat([torch.tensor(decode_slots, dtype=torch.int64), *chunk_slots])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            block_size=bs,
            num_decodes=len(decode_tables),
            decode_block_tables=decode_tables_t,
            decode_seq_lens=decode_lens_t,
            prefills=prefills,
        )
        return (
            torch.tensor(ids, device=dev),
            positions.to(dev),
            meta,
            torch.tensor(sample_rows, device=dev),
        )


def _first_layers(tensors: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors without those of layers n and up."""

    def layer(name: str) -> int | None:
        parts = name.split(".")
        return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else None

    return {k: v for k, v in tensors.items() if (i := layer(k)) is None or i < n}


def _is_prefill(item: ScheduledRequest) -> bool:
    """A chunk of several tokens attended as one causal block (not decode rows)."""
    return item.num_new_tokens != 1 and not item.spec_token_ids


def _split_kv(both: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[layers, 2, ...] -> K and V: views of the one gathered tensor (every reader of a
    PromptKV copies, slices or serializes them, none needs them contiguous)."""
    return both[:, 0], both[:, 1]
