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
        # Fair: a1's charge counts at once, so b1 comes second in the same step.
        first = [("a1", 4), ("b1", 4), ("a2", 4)] if fair else [("a1", 4), ("a2", 4), ("b1", 4)]
        assert step(s).scheduled == first
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


# -- displacement: a head with no room takes an over-served tenant's place -----------------
def decode_a_flood(s: Scheduler, n: int = 4) -> None:
    """Tenant a's n requests fill every slot and are past their prompts."""
    for i in range(n):
        s.add_request(req(f"a{i}", A))
    assert step(s).scheduled == [(f"a{i}", PROMPT) for i in range(n)]
    assert step(s).scheduled == [(f"a{i}", 1) for i in range(n)]


def test_a_light_tenant_displaces_the_floods_newest_request():
    s = make(fair=True, seqs=4, budget=64)
    decode_a_flood(s)
    s.add_request(req("a4", A))  # waits: a's own request never displaces a's
    s.add_request(req("b0", B))  # b holds 0 of 4 slots, a all 4: b0 takes a3's
    assert step(s) == ([("a0", 1), ("a1", 1), ("a2", 1), ("b0", PROMPT)], ["a3"], [])
    # b came in lifted to a's counter and has since been charged its prompt: more served,
    # so b1 waits while a's three running requests catch up, then takes a2's place (a's 3
    # slots > b's 1 + 1).
    assert s._waiting.served == {"a": 39.0, "b": 44.0}
    s.add_request(req("b1", B))
    for _ in range(2):
        assert step(s) == ([("a0", 1), ("a1", 1), ("a2", 1), ("b0", 1)], [], [])
    assert step(s) == ([("a0", 1), ("a1", 1), ("b0", 1), ("b1", PROMPT)], ["a2"], [])
    s.add_request(req("b2", B))  # 2 and 2: even, so b2 waits for a slot
    assert step(s) == ([("a0", 1), ("a1", 1), ("b0", 1), ("b1", 1)], [], [])
    assert [r.request_id for r in s.running] == ["a0", "a1", "b0", "b1"]
    # The displaced are recomputed later and finish with every token.
    done = []
    while s.has_unfinished():
        done += step(s).finished
    assert_drained(s)
    assert sorted(done) == sorted([f"a{i}" for i in range(5)] + ["b0", "b1", "b2"])


def test_first_come_first_served_never_displaces():
    s = make(fair=False, seqs=4, budget=64)
    decode_a_flood(s)
    s.add_request(req("b0", B))
    assert step(s) == ([(f"a{i}", 1) for i in range(4)], [], [])
    assert s._waiting.peek().request_id == "b0"


def test_displacement_is_not_undone_and_weights_set_the_share():
    heavy = TenantShare("a", weight=2.0)
    s = make(fair=True, seqs=4, budget=64)
    for i in range(4):
        s.add_request(req(f"a{i}", heavy))
    step(s)
    s.add_request(req("b0", B))
    s.add_request(req("b1", B))
    # a's 4 slots over weight 2 exceed b's (0 + 1) over 1: b0 takes a3's. Then a's 3 / 2 is
    # below b's (1 + 1) / 1: b1 waits, and a3 (now b's peer in the queue) takes nothing back.
    assert step(s) == ([("a0", 1), ("a1", 1), ("a2", 1), ("b0", PROMPT)], ["a3"], [])
    for _ in range(OUTPUT - 2):
        assert step(s).preempted == []


def test_displacement_stays_within_a_priority_class():
    s = make(fair=True, seqs=4, budget=64)
    decode_a_flood(s)
    s.add_request(req("b0", B, priority=1))  # less urgent than a's class: waits
    assert step(s).preempted == []
    s.add_request(req("b1", B, priority=-1))  # more urgent: first in line, but no displacing
    assert step(s).preempted == []
    assert s._waiting.peek().request_id == "b1"


def test_a_light_tenant_displaces_for_blocks_too():
    # 5 blocks of 4, slots to spare: a's two 6-token prompts hold 4 blocks (room to decode
    # to 8), and b's 8-token prompt needs 2 of them.
    s = make(fair=True, num_blocks=5, seqs=4, budget=64)
    s.add_request(req("a0", A, n=6))
    s.add_request(req("a1", A, n=6))
    assert step(s).scheduled == [("a0", 6), ("a1", 6)]
    s.add_request(req("b0", B))
    assert step(s) == ([("a0", 1), ("b0", PROMPT)], ["a1"], [])
    assert s.kv.block_ids("b0") == [3, 4]  # the free one and a1's tail, in pool order


def test_the_displaced_is_not_readmitted_in_the_same_step():
    # Room for b0 and for a1's first chunk again once a1 is out: a1 still waits a step.
    s = make(fair=True, num_blocks=6, seqs=4, budget=64)
    s.add_request(req("a0", A))
    s.add_request(req("a1", A))
    step(s)
    s.add_request(req("b0", B, n=4))
    out = step(s)
    assert out.preempted == ["a1"] and ("a1", PROMPT + 1) not in out.scheduled
    assert out.scheduled == [("a0", 1), ("b0", 4)]


# -- bounded counters -----------------------------------------------------------------------
def test_idle_tenants_counters_are_bounded_lru():
    q = FairQueue(max_idle=2)
    for i in range(5):
        r = req(f"r{i}", TenantShare(f"t{i}"))
        q.arrive(r)
        q.charge(r, 10 * (i + 1))
        q.leave(r)
    # Only the two most recently idle tenants' counters are kept.
    # Each came alone, lifted to the highest counter (10, 30, 60, ...), then charged.
    assert q.served == {"t3": 100.0, "t4": 150.0}
    held = req("h", TenantShare("t3"))
    q.arrive(held)  # t3 is active again: out of the idle set, its counter kept
    for i in range(5, 9):
        r = req(f"r{i}", TenantShare(f"t{i}"))
        q.arrive(r)
        q.leave(r)
    assert set(q.served) == {"t3", "t7", "t8"}
    # A forgotten tenant comes back like a newcomer: lifted to the least-served active one.
    back = req("back", TenantShare("t0"))
    q.arrive(back)
    assert q.served["t0"] == q.served["t3"]


# -- on a real engine ------------------------------------------------------------------------
def test_displaced_requests_finish_with_the_same_greedy_tokens(model_dir, prompts):
    """tiny-llama, two slots held by a heavy tenant: a light tenant's request takes the newest
    one's place; the displaced request is recomputed and every request's greedy tokens (and
    what was streamed) equal each one run alone."""
    from rtp_serve.engine import SamplingParams
    from tests.helpers import assert_pool_idle, drive, make_llm

    llama = model_dir("tiny-llama")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = make_llm(llama)
    refs = [out.token_ids for out in alone.generate(prompts[:3], params)]
    engine = make_llm(llama, max_num_seqs=2, fair_scheduling=True).engine
    heavy, light = TenantShare("heavy"), TenantShare("light")
    h0, h1 = (engine.make_request(f"h{i}", prompts[i], params, tenant=heavy) for i in (0, 1))
    l0 = engine.make_request("l0", prompts[2], params, tenant=light)
    final, streamed = drive(engine, {0: [h0, h1], 3: [l0]})
    assert (h0.num_preemptions, h1.num_preemptions, l0.num_preemptions) == (0, 1, 0)
    for rid, ref in zip(("h0", "h1", "l0"), refs, strict=True):
        assert final[rid].token_ids == ref
        assert streamed[rid] == ref
    assert_pool_idle(engine)


def test_a_swap_that_only_moves_the_imbalance_is_not_made():
    # One slot, held by a tenant of weight 0.5: giving it to a (weight 1) would leave the
    # holder below a's share, so a waits however much more b has been served per weight.
    half = TenantShare("b", weight=0.5)
    s = make(fair=True, seqs=1, budget=64)
    s.add_request(req("b0", half))
    step(s)
    s.add_request(req("a0", A))
    for _ in range(OUTPUT - 2):
        assert step(s) == ([("b0", 1)], [], [])
    assert step(s) == ([("b0", 1)], [], ["b0"])
    assert step(s).scheduled == [("a0", PROMPT)]


def test_under_a_flood_a_light_tenant_starts_at_once_for_little_recompute():
    """The benchmark's burst in scheduler steps: a keeps 32 requests in (8 slots), b sends a
    short one every 12 steps. Fair: each of b's starts in the step it arrives; FCFS: it waits
    behind a's queue. Tokens of finished requests (the useful work) stay within 2%."""
    results = {}
    for fair in (True, False):
        s = make(fair=fair, num_blocks=400, seqs=8, budget=2048)
        s.config = SchedulerConfig(8, 2048, 256, max_num_waiting=1024, fair=fair)
        arrived, waits, done, preempted, n = {}, [], 0, 0, 0
        requests = {}
        for t in range(600):
            while sum(r.tenant is A for r in s.requests.values()) < 32:
                r = requests[f"a{n}"] = long_req(f"a{n}", A, 64, 32, first=1000 * n)
                s.add_request(r)
                n += 1
            if t % 12 == 0:
                arrived[f"b{t}"] = t
                r = requests[f"b{t}"] = long_req(f"b{t}", B, 64, 8, first=10**6 + 1000 * t)
                s.add_request(r)
            out = step(s)
            done += sum(len(requests[rid].token_ids) for rid in out.finished)
            preempted += len(out.preempted)
            waits += [t - arrived.pop(rid) for rid, _ in out.scheduled if rid in arrived]
        results[fair] = (waits, done, preempted)
    (fair_waits, fair_done, fair_pre), (fcfs_waits, fcfs_done, fcfs_pre) = results.values()
    assert len(fair_waits) == 50 and set(fair_waits) == {0}
    assert sum(fcfs_waits) / len(fcfs_waits) > 50
    assert (fcfs_pre, 0) < (fair_pre, 0) and fair_pre <= 50
    assert fair_done >= 0.98 * fcfs_done


def long_req(rid: str, tenant: TenantShare, n: int, out: int, first: int) -> Request:
    params = SamplingParams(max_tokens=out, ignore_eos=True)
    return Request(rid, list(range(first, first + n)), params, BS, tenant=tenant)
