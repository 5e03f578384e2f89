"""The randomness of a sampled token, drawn per (request seed, position), never per step.

A random row picks `argmax(probs / E)` with E_i ~ Exp(1) i.i.d. (the exponential race, an
exact sampler of `probs`: the Gumbel-max trick in another form). E comes from a generator
seeded by the request's seed mixed with the position the token will occupy, so a token
depends only on its own distribution, seed and position: not on the batch it ran in, how
many steps came before, or whether it was verified as a speculative draft (engine/spec_decode/)
or sampled one step at a time. A PD decode worker continues a prefill worker's seeded
stream by position alone, and a stream resumed on another worker too.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): nearby seeds and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def exponential_noise(seed: int, position: int, n: int) -> torch.Tensor:
    """E [n] float32, E_i ~ Exp(1), a pure function of (seed, position)."""
    gen = torch.Generator().manual_seed(_mix(seed, position))
    return torch.empty(n, dtype=torch.float32).exponential_(generator=gen)


def draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """One token from `probs` [V] (CPU, float32, summing to 1; zeros are never drawn)."""
    return int((probs / exponential_noise(seed, position, probs.shape[-1])).argmax())
