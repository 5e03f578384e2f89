"""Offline batch inference: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "float32", **engine_args) -> None:
        if model is None:
            from engine.make_model import ensure_model

            model = str(ensure_model())
        self.engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in prompt order, with `.text` decoded."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        # Validate everything before queueing anything: a bad prompt loses nothing.
        requests = [
            self.engine.make_request(str(next(self._ids)), prompt, p)
            for prompt, p in zip(prompts, per_prompt, strict=True)
        ]
        for request in requests:
            self.engine.add_request(request)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(requests):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [self._with_text(final[r.request_id]) for r in requests]

    def _with_text(self, out: RequestOutput) -> RequestOutput:
        return replace(out, text=self.tokenizer.decode(out.token_ids))
