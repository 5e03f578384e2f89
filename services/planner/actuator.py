"""How the planner's decisions reach the workers: the interface every actuator implements.

    planner loop --decide--> Actuator.scale(role, target, victims)
                                 local:   worker processes this planner starts and stops
                                 docker:  the compose service's containers (Engine API)
                                 metrics: nothing here; the desired counts are published as
                                          metrics and the platform's autoscaler (a
                                          Kubernetes HPA on external metrics) acts on them

Scale-down never fails a request: an actuator stops a worker with SIGTERM only. The worker
then leaves the nameservice (the master and frontends stop routing to it), finishes what it
runs for up to its --drain-timeout, and ends what is left UNAVAILABLE, which the frontend
resumes on another worker (services/worker/drain.py); only then does it exit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

ROLES = ("fused", "prefill", "decode")


class Actuator(Protocol):
    """Starts and stops workers of each role."""

    name: str

    async def replicas(self) -> dict[str, int]:
        """Role -> workers this actuator runs now, started or starting, not counting those
        it is stopping (they drain and are gone)."""
        ...

    async def scale(self, role: str, target: int, victims: Sequence[str] = ()) -> None:
        """Make `role` have `target` workers: start the missing ones, or stop the surplus
        gracefully (SIGTERM, never SIGKILL before the drain timeout). `victims`: member ids
        of that role, the ones to stop first (least loaded first); an actuator that cannot
        tell which of its workers is which member stops its newest. Returns once the change
        is under way (a stopping worker may still be draining)."""
        ...

    async def close(self) -> None:
        """Release what the actuator holds. Workers it started stop with it only if it owns
        them as processes (local); containers and Deployments stay as they are."""
        ...


class MetricsActuator:
    """Kubernetes: the planner acts on nothing itself. Its desired replica counts are its
    `rtp:planner_desired_workers` gauge; a HorizontalPodAutoscaler per Deployment reads it
    through the external-metrics API (deploy/k8s/planner.yaml) and scales, and its
    scale-down sends each removed pod SIGTERM, so the workers drain as above."""

    name = "metrics"

    def __init__(self, registered: Callable[[], dict[str, int]]) -> None:
        """`registered`: workers of each role in the nameservice now (what the HPA runs)."""
        self.desired: dict[str, int] = {}
        self._registered = registered

    async def replicas(self) -> dict[str, int]:
        counts = self._registered()
        return {role: counts.get(role, 0) for role in ROLES}

    async def scale(self, role: str, target: int, victims: Sequence[str] = ()) -> None:
        self.desired[role] = target

    async def close(self) -> None:
        return None
