"""Tenants: whom an API key serves, with what share of the workers and what limits.

The key file (`--api-key-file`, and the `--api-key` / RTP_API_KEYS entries) has one key a
line, with optional attributes after it:

    KEY [tenant=NAME] [weight=W] [tpm=N] [rpm=N] [concurrency=N] [priority=N]

    tenant       the tenant the key belongs to ("default" without it); keys may share one
    weight       the tenant's share of a worker against other tenants with work waiting
                 (default 1; the workers' scheduler, engine/fair_queue.py)
    tpm          tokens per minute: prompt tokens on arrival, output tokens as they stream
    rpm          requests per minute
    concurrency  requests in flight at once
    priority     the most urgent priority the key may ask for (per key; auth.py)

weight, tpm, rpm and concurrency belong to the tenant: set on more than one of its keys, they
must agree. Without keys every request is the default tenant's: weight 1, no limits.

Metrics are labelled by tenant, but only the `labels` most important tenants (highest weight,
then first in the file) get a label of their own; the rest share "other", so ten thousand
keys do not make ten thousand series. The set is fixed at start: a counter's series never
moves from one label to another.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from rtp_serve.core.tenant import DEFAULT_TENANT, TenantShare

OTHER = "other"  # the metrics label of tenants past the top ones
DEFAULT_LABELS = 16
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_LIMITS = {"tpm": "tokens_per_minute", "rpm": "requests_per_minute", "concurrency": "concurrency"}


@dataclass(frozen=True, slots=True)
class TenantSpec:
    name: str = DEFAULT_TENANT
    weight: float = 1.0
    tokens_per_minute: int | None = None  # None: no limit
    requests_per_minute: int | None = None
    concurrency: int | None = None

    @property
    def share(self) -> TenantShare:
        return TenantShare(self.name, self.weight)


class KeyLine(NamedTuple):
    """One key entry: the key, its priority floor (None: --priority-floor), its tenant and
    the tenant attributes the line sets."""

    key: str
    floor: int | None = None
    tenant: str = DEFAULT_TENANT
    attrs: tuple[tuple[str, float], ...] = ()  # (TenantSpec field, value)


def parse_line(entry: str) -> KeyLine:
    """`KEY [name=value ...]` -> KeyLine; ValueError for anything else, so a mistyped
    attribute stops the frontend at start rather than being taken as part of a key. (The
    text is never echoed: it may be part of a key.)"""
    key, *words = entry.split()
    floor, tenant, attrs = None, DEFAULT_TENANT, []
    for word in words:
        name, _, value = word.partition("=")
        if name == "priority":
            floor = _number(name, value, int)
        elif name == "tenant":
            if not set(value) <= _NAME_CHARS or not 0 < len(value) <= 64 or value == OTHER:
                raise ValueError(
                    "an API key entry's tenant=NAME takes 1 to 64 letters, digits or '._-' "
                    f"(not {OTHER!r}: the metrics label of the tenants past the top ones)"
                )
            tenant = value
        elif name == "weight":
            weight = _number(name, value, float)
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError("an API key entry's weight=W must be a positive number")
            attrs.append(("weight", weight))
        elif name in _LIMITS:
            limit = _number(name, value, int)
            if limit <= 0:
                raise ValueError(f"an API key entry's {name}=N must be a positive integer")
            attrs.append((_LIMITS[name], limit))
        else:
            raise ValueError(
                "an API key entry may carry only tenant=, weight=, tpm=, rpm=, concurrency= "
                "and priority= after the key"
            )
    return KeyLine(key, floor, tenant, tuple(attrs))


def _number(name: str, value: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"an API key entry's {name}= must be {what}") from None


@dataclass(frozen=True, slots=True)
class TenantTable:
    """Every configured tenant (the default one always), and its metrics label."""

    specs: dict[str, TenantSpec] = field(default_factory=lambda: {DEFAULT_TENANT: TenantSpec()})
    labels: dict[str, str] = field(default_factory=lambda: {DEFAULT_TENANT: DEFAULT_TENANT})

    @classmethod
    def of(cls, lines: Iterable[KeyLine], num_labels: int = DEFAULT_LABELS) -> TenantTable:
        """The tenants `lines` name; ValueError when two lines give one tenant different
        values of an attribute (the message names the tenant and the attribute)."""
        specs: dict[str, TenantSpec] = {DEFAULT_TENANT: TenantSpec()}
        given: dict[tuple[str, str], float] = {}
        for line in lines:
            spec = specs.setdefault(line.tenant, TenantSpec(line.tenant))
            for name, value in line.attrs:
                if given.setdefault((line.tenant, name), value) != value:
                    raise ValueError(
                        f"tenant {line.tenant!r}: its keys give {name} two different values"
                    )
                spec = replace(spec, **{name: value})
            specs[line.tenant] = spec
        order = {name: i for i, name in enumerate(specs)}
        ranked = sorted(specs.values(), key=lambda s: (-s.weight, order[s.name]))
        top = {s.name for s in ranked[:num_labels]}
        labels = {name: name if name in top else OTHER for name in specs}
        return cls(specs, labels)

    def get(self, name: str) -> TenantSpec:
        return self.specs.get(name) or self.specs[DEFAULT_TENANT]

    def label(self, name: str) -> str:
        return self.labels.get(name, OTHER)
