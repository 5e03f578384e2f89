"""Who a request is served for: its tenant and the tenant's weight.

The frontend maps an API key to a tenant (services/frontend/tenants.py); the tenant's name
and weight travel with the request to the workers, whose scheduler shares each priority
class between tenants by weighted tokens served (engine/fair_queue.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_TENANT = "default"  # every request of a server without keys, or a key without one


@dataclass(frozen=True, slots=True)
class TenantShare:
    name: str = DEFAULT_TENANT
    # Its share of a worker against other tenants with work waiting: a tenant of weight 2
    # is served twice the tokens of one of weight 1.
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tenant needs a name")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"a tenant's weight must be positive, got {self.weight}")


DEFAULT_SHARE = TenantShare()
