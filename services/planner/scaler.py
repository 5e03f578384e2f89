"""From the workers the arithmetic wants to the workers the planner asks for: bounds, steps,
cool-down, the worker budget, and zero.

    wanted (sizing) -> floors (min workers; 1 a role while there is demand)
                    -> budget (--max-workers over all roles, shared in proportion)
                    -> steps  (up at once, at most max_step_up a decision;
                               down one at a time, after down_cooldown_s of quiet)
                    -> zero   (with min_workers 0: every role, once no request arrived
                               or waited for idle_to_zero_s)

Scaling up is never delayed by a cool-down: a request waiting for a worker is worse than a
worker idling. Scaling down waits for the cool-down after any change, so a dip between
bursts does not stop workers the next burst needs (and each stop costs a drain).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Limits:
    min_workers: int = 1  # per role in use; 0 allows scale to zero
    max_workers: int = 8  # all roles together
    max_step_up: int = 4
    max_step_down: int = 1
    down_cooldown_s: float = 30.0
    idle_to_zero_s: float = 60.0

    def __post_init__(self) -> None:
        if self.min_workers < 0 or self.max_workers < 1:
            raise ValueError("need min_workers >= 0 and max_workers >= 1")
        if self.max_step_up < 1 or self.max_step_down < 1:
            raise ValueError("scale steps must be >= 1")


@dataclass(frozen=True, slots=True)
class Decision:
    targets: dict[str, int]
    reason: str

    def changes(self, current: dict[str, int]) -> dict[str, int]:
        return {r: n for r, n in self.targets.items() if n != current.get(r, 0)}


@dataclass(slots=True)
class Scaler:
    limits: Limits
    roles: tuple[str, ...]  # ("fused",) or ("prefill", "decode")
    _last_change: float = field(default=-1e18, init=False)
    _last_demand: float | None = field(default=None, init=False)

    def decide(
        self, now: float, current: dict[str, int], wanted: dict[str, int], demand: bool
    ) -> Decision:
        """`demand`: a request arrived in the last interval or waits for a worker now."""
        lim = self.limits
        if demand or self._last_demand is None:
            self._last_demand = now
        idle_s = now - self._last_demand
        if lim.min_workers == 0 and not demand and idle_s >= lim.idle_to_zero_s:
            targets = dict.fromkeys(self.roles, 0)
            return self._commit(now, current, targets, f"idle {idle_s:.0f}s: scale to zero")
        # Demand keeps one of each role; so does a recent one, until the idle time is up
        # (only scale to zero stops the last worker, and only a request starts the first).
        floor = {
            r: max(lim.min_workers, 1 if demand else min(1, current.get(r, 0))) for r in self.roles
        }
        want = {r: max(wanted.get(r, 0), floor[r]) for r in self.roles}
        # At zero with demand, no cool-down and no idle wait applies: start one of each.
        want = self._budget(want)
        targets: dict[str, int] = {}
        why: list[str] = []
        for role in self.roles:
            have, goal = current.get(role, 0), want[role]
            if goal > have:
                targets[role] = min(goal, have + lim.max_step_up)
                why.append(f"{role} {have}->{targets[role]} (wants {goal})")
            elif goal < have and now - self._last_change >= lim.down_cooldown_s:
                targets[role] = max(goal, have - lim.max_step_down)
                why.append(f"{role} {have}->{targets[role]} (wants {goal})")
            else:
                targets[role] = have
                if goal < have:
                    why.append(f"{role} stays {have} (wants {goal}; cooling down)")
        return self._commit(now, current, targets, "; ".join(why) or "steady")

    def _budget(self, want: dict[str, int]) -> dict[str, int]:
        """Shrink `want` to max_workers in all, in proportion (largest remainders), keeping
        one of each role that wants any."""
        total, cap = sum(want.values()), self.limits.max_workers
        if total <= cap:
            return want
        active = [r for r in self.roles if want[r] > 0]
        cap = max(cap, len(active))
        shares = {r: want[r] * cap / total for r in active}
        out = {r: max(1, int(shares.get(r, 0))) if r in shares else 0 for r in self.roles}
        for r in sorted(active, key=lambda r: shares[r] - int(shares[r]), reverse=True):
            if sum(out.values()) >= cap:
                break
            out[r] += 1
        while sum(out.values()) > cap:  # the floors of 1 may overshoot: take from the largest
            largest = max(active, key=lambda r: out[r])
            out[largest] -= 1
        return out

    def _commit(
        self, now: float, current: dict[str, int], targets: dict[str, int], why: str
    ) -> Decision:
        decision = Decision(targets, why)
        if decision.changes(current):
            self._last_change = now
        return decision
