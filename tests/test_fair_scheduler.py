"""Tenants sharing a worker (engine/fair_queue.py), driven without a model: exact admission
orders, preemption victims and counters, against first come, first served on the same
script."""

from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.core.tenant import TenantShare
from rtp_serve.engine.block_pool import BlockPool
from rtp_serve.engine.fair_queue import FairQueue
from rtp_serve.engine.kv_cache_manager import KVCacheManager
from rtp_serve.engine.request import Request, RequestStatus
from rtp_serve.engine.scheduler import Scheduler, SchedulerConfig
from tests.test_scheduler import BS, EOS, assert_drained, step

A, B = TenantShare("a"), TenantShare("b")
PROMPT, OUTPUT = 8, 8  # every request: 16 tokens computed
SEQS = 2


def make(fair: bool, num_blocks: int = 64, seqs: int = SEQS, budget: int = 16) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BS, enable_caching=False)
    config = SchedulerConfig(seqs, budget, 64, max_num_waiting=1024, fair=fair)
    return Scheduler(config, kv, (EOS,))


def req(rid: str, tenant: TenantShare, n: int = PROMPT, priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    return Request(rid, list(range(1, n + 1)), params, BS, priority=priority, tenant=tenant)


def flood(s: Scheduler, a: TenantShare, b: TenantShare, n: int = 20) -> None:
    """Tenant a's n requests arrive first, then tenant b's n."""
    for i in range(n):
        s.add_request(req(f"a{i}", a))
    for i in range(n):
        s.add_request(req(f"b{i}", b))


def run(s: Scheduler, a: TenantShare, b: TenantShare, steps: int) -> list[float]:
    """Steps while both tenants have work; the gap in weighted service after each."""
    gaps = []
    for _ in range(steps):
        step(s)
        served = s._waiting.served
        gaps.append(abs(served[a.name] - served[b.name]))
    return gaps


# While both are backlogged, the gap in weighted tokens served stays below what the requests
# running at once can be charged (VTC's bound: each tenant lags at most the work in flight).
BOUND = 2 * SEQS * (PROMPT + OUTPUT)


def test_service_difference_is_bounded_while_both_are_backlogged():
    fair = make(fair=True)
    flood(fair, A, B)
    gaps = run(fair, A, B, steps=60)
    assert max(gaps) <= BOUND
    fcfs = make(fair=False)
    flood(fcfs, A, B)
    # First come, first served: b waits behind all of a's, and the gap grows past it.
    assert max(run(fcfs, A, B, steps=60)) > 2 * BOUND


def test_weights_share_tokens_two_to_one():
    heavy = TenantShare("a", weight=2.0)
    s = make(fair=True)
    flood(s, heavy, B, n=30)
    steps = 80  # both still backlogged after it
    gaps = run(s, heavy, B, steps)
    assert max(gaps) <= BOUND  # weighted service (tokens / weight) stays level
    raw = {t: s._waiting.served[t.name] * t.weight for t in (heavy, B)}
    assert s.num_waiting > 0 and {r.tenant for r in s._waiting} == {heavy, B}
    assert abs(raw[heavy] - 2 * raw[B]) <= 2 * BOUND
    assert raw[heavy] > 1.5 * raw[B]


def test_one_tenant_schedules_exactly_as_first_come_first_served():
    traces = []
    for fair in (True, False):
        s = make(fair=fair, num_blocks=8, seqs=3)  # tight: preemptions happen
        for i in range(6):
            s.add_request(req(f"r{i}", A, n=6 + i, priority=i % 2))
        traces.append([step(s) for _ in range(60)])
        assert_drained(s)
    assert traces[0] == traces[1]
    assert any(t.preempted for t in traces[0])


def test_work_conserving_two_tenants_finish_when_fcfs_does():
    totals = []
    for fair in (True, False):
        s = make(fair=fair)
        flood(s, A, B, n=6)
        per_step = []
        while s.has_unfinished():
            per_step.append(sum(n for _, n in step(s).scheduled))
        assert_drained(s)
        totals.append(per_step)
    # The same tokens every step (slots never idle while anyone waits), in another order.
    assert totals[0] == totals[1]


def test_a_tenant_alone_gets_the_whole_worker():
    s = make(fair=True, seqs=4, budget=64)
    for i in range(4):
        s.add_request(req(f"a{i}", A))
    assert step(s).scheduled == [(f"a{i}", PROMPT) for i in range(4)]
    assert step(s).scheduled == [(f"a{i}", 1) for i in range(4)]


def test_preemption_picks_the_most_served_tenant():
    victims = []
    for fair in (True, False):
        # 5 blocks of 4: three 4-token prompts fit, but not their second blocks.
        s = make(fair=fair, num_blocks=5, seqs=3, budget=64)
        for r in (req("a1", A, n=4), req("a2", A, n=4), req("b1", B, n=4)):
            s.add_request(r)
        assert step(s).scheduled == [("a1", 4), ("a2", 4), ("b1", 4)]
        assert s._waiting.served == {"a": 8.0, "b": 4.0}
        victims.append(step(s).preempted)
    # Fair: a, served twice b's, loses its newest; first come, first served: the newest.
    assert victims == [["a2"], ["b1"]]


def test_priority_classes_come_before_fairness():
    s = make(fair=True, seqs=1)
    s.add_request(req("a0", A))
    for _ in range(4):
        step(s)  # a is served; b has not arrived
    s.add_request(req("b0", B, priority=0))
    s.add_request(req("a1", A, priority=-1))  # more urgent, from the more-served tenant
    while "a0" not in step(s).finished:
        pass
    assert s._waiting.served["a"] > s._waiting.served["b"]
    assert step(s).scheduled == [("a1", PROMPT)]
    q = FairQueue()
    urgent, lax = req("u", A, priority=0), req("l", B, priority=5)
    for r in (urgent, lax):
        q.arrive(r)
        r.status = RequestStatus.RUNNING
    q.charge(urgent, 100)
    assert q.victim([urgent, lax]) is lax  # the less urgent class goes first, though less served


def test_an_idle_tenant_banks_no_credit():
    q = FairQueue()
    a0, b0 = req("a0", A), req("b0", B)
    q.arrive(a0)
    q.charge(a0, 100)
    q.arrive(b0)  # b arrives while a is active: lifted to a's level, not left at 0
    assert q.served == {"a": 100.0, "b": 100.0}
    q.charge(b0, 50)
    q.leave(a0)
    q.leave(b0)
    a1 = req("a1", A)
    q.arrive(a1)  # alone again: lifted to the highest counter, so no credit from idling
    assert q.served["a"] == 150.0
    q.push(a1)
    assert q.peek() is a1 and len(q) == 1
    q.remove(a1)
    assert not q
