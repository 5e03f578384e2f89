"""The engine's refusals a service maps to a status, torch-free (the simulated engine
raises them too)."""

from __future__ import annotations


class EngineStoppedError(RuntimeError):
    """The engine shut down with this request unfinished (the caller may retry elsewhere)."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound: this worker cannot take the request now."""
