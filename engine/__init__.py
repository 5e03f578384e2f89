"""Model execution shared by prefill, decode and fused workers.

Names are resolved lazily (PEP 562) so that torch-free modules of this package, such as
`engine.tokenizer`, can be imported by services that must not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "engine.llm",
    "AsyncLLM": "engine.async_llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "StructuredOutputs": "engine.structured",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "StructuredOutputs",
]

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams
    from engine.structured import StructuredOutputs


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
