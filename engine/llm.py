"""Offline batch inference: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from rtp_serve.core.dtypes import resolve_dtype
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.engine.config import EngineConfig
from rtp_serve.engine.llm_engine import LLMEngine
from rtp_serve.engine.outputs import CompletionOutput, OutputCollector


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_args) -> None:
        """`dtype` "auto" serves the checkpoint's own dtype (core.dtypes.resolve_dtype)."""
        if model is None:
            from rtp_serve.models.make_model import ensure_model

            model = str(ensure_model())
        dtype = resolve_dtype(dtype, model)
        self.engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str] = "",
    ) -> list[CompletionOutput]:
        """One finished output per prompt, in prompt order, with `.text` decoded. `lora`:
        the adapter of every prompt, or one per prompt ("" the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        loras = [lora] * len(prompts) if isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} adapters for {len(prompts)} prompts")
        # Validate everything before queueing anything: a bad prompt loses nothing.
        requests = [
            self.engine.make_request(str(next(self._ids)), prompt, p, lora=name)
            for prompt, p, name in zip(prompts, per_prompt, loras, strict=True)
        ]
        collectors = {
            r.request_id: OutputCollector(r.request_id, r.prompt_token_ids) for r in requests
        }
        for request in requests:
            self.engine.add_request(request)
        pending = len(requests)
        while pending:
            for out in self.engine.step():
                collectors[out.request_id].add(out)
                pending -= out.finished
        return [c.result(self.tokenizer.decode(c.token_ids)) for c in collectors.values()]
