"""Next interval's demand from the past ones: small predictors that can be explained.

Each takes one observation per planner interval and forecasts the next interval's value.

    last value:  forecast = x[t]
    Holt:        level[t] = a * x[t] + (1 - a) * (level[t-1] + trend[t-1])
                 trend[t] = b * (level[t] - level[t-1]) + (1 - b) * trend[t-1]
                 forecast = max(0, level[t] + trend[t])

Holt's linear trend (double exponential smoothing) follows a ramp one interval ahead instead
of lagging it, and smooths the noise of short windows. A day's shape is too slow for a
seasonal term to matter at a planner's interval of seconds; the scaler's floor on what was
just observed (services/planner/scaler.py) covers a burst the trend has not seen yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Predictor(Protocol):
    name: str

    def observe(self, value: float) -> None: ...

    def forecast(self) -> float:
        """The next interval's value (0 before any observation)."""
        ...


@dataclass(slots=True)
class LastValue:
    name: str = "last"
    _last: float = 0.0

    def observe(self, value: float) -> None:
        self._last = value

    def forecast(self) -> float:
        return self._last


@dataclass(slots=True)
class Holt:
    alpha: float = 0.5  # weight of the newest observation in the level
    beta: float = 0.3  # weight of the newest level change in the trend
    name: str = "holt"
    _level: float | None = field(default=None, init=False)
    _trend: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        for which, value in (("alpha", self.alpha), ("beta", self.beta)):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{which} must be in (0, 1], got {value}")

    def observe(self, value: float) -> None:
        if self._level is None:
            self._level = value
            return
        previous = self._level
        self._level = self.alpha * value + (1 - self.alpha) * (previous + self._trend)
        self._trend = self.beta * (self._level - previous) + (1 - self.beta) * self._trend

    def forecast(self) -> float:
        if self._level is None:
            return 0.0
        return max(0.0, self._level + self._trend)


@dataclass(slots=True)
class Ewma:
    """A smoothed mean (prompt and output lengths: they drift, they do not trend)."""

    alpha: float = 0.3
    value: float | None = None

    def observe(self, x: float) -> None:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value


PREDICTORS = {"holt": Holt, "last": LastValue}


def make(name: str) -> Predictor:
    try:
        return PREDICTORS[name]()
    except KeyError:
        raise ValueError(f"unknown predictor {name!r} (one of {sorted(PREDICTORS)})") from None
