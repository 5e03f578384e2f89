"""How long a step takes: a profile fitted on the real engine, loadable from JSON (the
simulated workers step by it; the planner sizes by it before workers report their own).

    step_s = fixed_s
           + prefill_token_s * p + prefill_attn_s * p * c / 1000
           + decode_row_s * r    + decode_ctx_s * C / 1000

p: prompt tokens computed in the step, c: the context they attend to (tokens before and
within the chunk, per token on average); r: decoding requests, C: their summed context.
bench/fit_sim.py fits it from timed steps of the real engine on this machine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True, slots=True)
class SimCost:
    fixed_s: float = 0.002
    prefill_token_s: float = 5e-5
    prefill_attn_s: float = 1e-6  # per prompt token per 1,000 tokens of context
    decode_row_s: float = 1e-3
    decode_ctx_s: float = 1e-6  # per 1,000 tokens of summed decode context
    source: str = "default"  # where the numbers come from (a fit's machine and model)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "source" and not value >= 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")

    def step_s(
        self, prefill_tokens: int, prefill_ctx: float, decode_rows: int, decode_ctx: int
    ) -> float:
        return (
            self.fixed_s
            + self.prefill_token_s * prefill_tokens
            + self.prefill_attn_s * prefill_tokens * prefill_ctx / 1000
            + self.decode_row_s * decode_rows
            + self.decode_ctx_s * decode_ctx / 1000
        )

    @classmethod
    def load(cls, path: str | Path) -> SimCost:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown fields in {path}: {sorted(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")
