"""How fast this engine works, from its recent steps, and what that means for a new request's
wait.

Two moving averages (EWMA, so a change of load shows within a few steps):

    prefill_tokens_per_s   prompt tokens computed per second, over steps that ran a prompt
                           chunk (the decode tokens riding along count as cost: conservative)
    decode_step_s          seconds of a step that only decodes the running batch

A request that arrives now waits for the prompt tokens queued before it, and for the step
the running batch is in:

    queue_wait_s = queued_tokens / prefill_tokens_per_s + (decode_step_s if running else 0)

Before any step has been measured both rates are 0 ("unknown") and so is the estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.2  # weight of the newest step


@dataclass(frozen=True, slots=True)
class StepRate:
    """A snapshot of the measured rates (0: not measured yet)."""

    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0

    def queue_wait_s(self, queued_tokens: int, num_running: int) -> float:
        """Seconds before a request arriving now gets its first step (0 if unmeasured)."""
        wait = queued_tokens / self.prefill_tokens_per_s if self.prefill_tokens_per_s else 0.0
        return wait + (self.decode_step_s if num_running else 0.0)


class StepTimer:
    """Folds each step's duration and work into a StepRate."""

    __slots__ = ("rate",)

    def __init__(self) -> None:
        self.rate = StepRate()

    def observe(self, seconds: float, prompt_tokens: int, decode_tokens: int) -> None:
        if seconds <= 0:
            return
        r = self.rate
        if prompt_tokens:
            tps = _ewma(r.prefill_tokens_per_s, prompt_tokens / seconds)
            self.rate = StepRate(tps, r.decode_step_s)
        elif decode_tokens:
            self.rate = StepRate(r.prefill_tokens_per_s, _ewma(r.decode_step_s, seconds))


def _ewma(old: float, new: float) -> float:
    return new if old == 0.0 else old + ALPHA * (new - old)
