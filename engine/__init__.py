"""Model execution shared by prefill, decode and fused workers.

Names are resolved lazily (PEP 562) so that torch-free modules of this package, such as
`rtp_serve.core.tokenizer`, can be imported by services that must not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "rtp_serve.engine.llm",
    "AsyncLLM": "rtp_serve.engine.async_llm",
    "LLMEngine": "rtp_serve.engine.llm_engine",
    "EngineConfig": "rtp_serve.engine.config",
    "SamplingParams": "rtp_serve.core.sampling_params",
    "RequestOutput": "rtp_serve.engine.outputs",
    "StructuredOutputs": "rtp_serve.core.structured",
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
    from rtp_serve.core.sampling_params import SamplingParams
    from rtp_serve.core.structured import StructuredOutputs
    from rtp_serve.engine.async_llm import AsyncLLM
    from rtp_serve.engine.config import EngineConfig
    from rtp_serve.engine.llm import LLM
    from rtp_serve.engine.llm_engine import LLMEngine
    from rtp_serve.engine.outputs import RequestOutput


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rtp_serve.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
