"""Scheduler driven without a model: exact (request, new tokens) per step, fabricated samples."""

from typing import NamedTuple

import pytest

from rtp_serve.core.outputs import SampledToken
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.engine.block_pool import BlockPool
from rtp_serve.engine.kv_cache_manager import KVCacheManager
from rtp_serve.engine.request import Request, RequestStatus
from rtp_serve.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig

BS = 4
EOS = 0


def make(
    num_blocks: int = 16,
    max_num_seqs: int = 4,
    budget: int = 64,
    max_model_len: int = 64,
    caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BS, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), kv, (EOS,))


def req(rid: str, n: int, first: int = 1, priority: int = 0, **params) -> Request:
    """A request whose prompt is `n` consecutive token ids from `first`."""
    tokens = list(range(first, first + n))
    return Request(rid, tokens, SamplingParams(**params), BS, priority=priority)


class Step(NamedTuple):
    scheduled: list[tuple[str, int]]
    preempted: list[str]
    finished: list[str]


def step(s: Scheduler, tokens: dict[str, int] | None = None, cap: int | None = None) -> Step:
    """One engine step (`cap`: its prompt_cap). A request samples `tokens[id]`, or by default
    1000 + its length."""
    tokens = tokens or {}
    out = s.schedule(cap)
    sampled = {}
    for item in out.scheduled:
        r = item.request
        if item.samples:
            sampled[r.request_id] = [
                SampledToken(tokens.get(r.request_id, 1000 + len(r.token_ids)))
            ]
    _, finished = s.update_from_output(out, sampled)
    s.check_integrity()
    return Step(
        [(i.request.request_id, i.num_new_tokens) for i in out.scheduled],
        out.preempted,
        [r.request_id for r in finished],
    )


def assert_drained(s: Scheduler) -> None:
    assert not s.has_unfinished()
    assert (s.num_running, s.num_waiting, s.kv.num_requests) == (0, 0, 0)
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_chunked_prefill_within_the_token_budget():
    s = make(budget=8)
    a, b = req("a", 10, max_tokens=3), req("b", 6, first=50, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    assert step(s) == Step([("a", 8)], [], [])
    assert (a.num_computed_tokens, a.num_output_tokens) == (8, 0)
    assert step(s) == Step([("a", 2), ("b", 6)], [], [])
    assert (s.kv.block_ids("a"), s.kv.block_ids("b")) == ([0, 1, 2], [3, 4])
    assert step(s) == Step([("a", 1), ("b", 1)], [], [])
    assert step(s) == Step([("a", 1), ("b", 1)], [], ["a", "b"])
    assert a.output_token_ids == [1010, 1011, 1012]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert a.status.finish_reason == "length"
    assert_drained(s)


def test_decodes_are_scheduled_before_waiting_prompts():
    s = make(budget=8)
    s.add_request(req("a", 4, max_tokens=3))
    assert step(s).scheduled == [("a", 4)]
    s.add_request(req("b", 10, first=50, max_tokens=1))
    assert step(s).scheduled == [("a", 1), ("b", 7)]
    assert step(s) == Step([("a", 1), ("b", 3)], [], ["a", "b"])
    assert_drained(s)


def test_max_num_seqs_caps_the_running_set():
    s = make(max_num_seqs=2)
    for i, rid in enumerate("abc"):
        s.add_request(req(rid, 4, first=10 * i, max_tokens=2))
    assert step(s).scheduled == [("a", 4), ("b", 4)]
    assert s.num_waiting == 1
    assert step(s) == Step([("a", 1), ("b", 1)], [], ["a", "b"])
    assert step(s).scheduled == [("c", 4)]
    assert step(s).finished == ["c"]
    assert_drained(s)


def test_priority_orders_admission_fcfs_within_a_level():
    s = make(max_num_seqs=1)
    for rid, priority in [("a", 1), ("b", 0), ("c", 0), ("d", 1), ("e", -1)]:
        s.add_request(req(rid, 4, priority=priority, max_tokens=1))
    order = [step(s).finished for _ in range(5)]
    assert order == [["e"], ["b"], ["c"], ["a"], ["d"]]
    assert_drained(s)


def test_prefix_hit_sets_computed_and_cached_tokens():
    s = make()
    s.add_request(req("a", 10, max_tokens=1))
    assert step(s) == Step([("a", 10)], [], ["a"])
    b = Request("b", list(range(1, 9)) + [50, 51, 52], SamplingParams(max_tokens=2), BS)
    s.add_request(b)
    assert step(s).scheduled == [("b", 3)]
    assert (b.num_cached_tokens, b.num_computed_tokens) == (8, 11)
    assert s.kv.block_ids("b") == [0, 1, 3]
    assert step(s) == Step([("b", 1)], [], ["b"])
    # Exactly the cached prefix of a prompt: the block with its last token is recomputed.
    c = req("c", 8, max_tokens=1)
    s.add_request(c)
    assert step(s) == Step([("c", 4)], [], ["c"])
    assert c.num_cached_tokens == 4
    assert_drained(s)


def test_preemption_recomputes_the_newest_request_and_keeps_its_output():
    s = make(num_blocks=4, caching=False)
    a, b = req("a", 7, max_tokens=4), req("b", 7, first=50, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    assert step(s).scheduled == [("a", 7), ("b", 7)]
    assert step(s).scheduled == [("a", 1), ("b", 1)]
    assert s.kv.pool.num_free_blocks == 0
    # a needs a third block: b (newest) is preempted and its blocks go to a.
    assert step(s) == Step([("a", 1)], ["b"], [])
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.WAITING, 0, 1)
    assert s.kv.block_ids("b") == []
    assert s.kv.block_ids("a") == [0, 1, 3]
    assert b.output_token_ids == [1007, 1008]
    assert step(s) == Step([("a", 1)], [], ["a"])
    # b recomputes its prompt and both generated tokens, then carries on.
    assert step(s) == Step([("b", 9)], [], [])
    assert b.output_token_ids == [1007, 1008, 1009]
    assert step(s) == Step([("b", 1)], [], ["b"])
    assert b.output_token_ids == [1007, 1008, 1009, 1010]
    assert_drained(s)


def test_preempting_a_request_scheduled_earlier_in_the_step_undoes_it():
    # Regression: a (low priority) is scheduled first, then preempted so b can run; the
    # block a filled in that step was cached but never computed, and must not stay cached.
    s = make(num_blocks=7, budget=16)
    a, b = req("a", 6, priority=1, max_tokens=8), req("b", 40, first=100, max_tokens=1)
    s.add_request(a)
    assert step(s).scheduled == [("a", 6)]
    s.add_request(b)
    assert step(s).scheduled == [("a", 1), ("b", 15)]
    assert step(s) == Step([], ["a", "b"], [])
    pool = s.kv.pool
    assert pool.get_cached(a.block_hashes[0]) is pool.blocks[0]
    assert pool.get_cached(a.block_hashes[1]) is None
    assert s.abort("b") is b
    assert step(s).scheduled == [("a", 4)]  # block 0 hit; the block with a's last token redone
    assert a.num_cached_tokens == 0  # set when first scheduled, not on re-admission
    s.abort("a")
    assert_drained(s)


def test_finish_on_eos_unless_ignored():
    s = make()
    a, b = req("a", 4), req("b", 4, first=10, ignore_eos=True, max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    assert step(s, {"a": EOS, "b": EOS}).finished == ["a"]
    assert (a.status, a.stop_reason, a.output_token_ids) == (
        RequestStatus.FINISHED_STOPPED,
        None,
        [EOS],
    )
    assert a.status.finish_reason == "stop"
    assert step(s, {"b": EOS}).finished == ["b"]
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert_drained(s)


def test_finish_on_stop_token_sets_stop_reason():
    s = make()
    a = req("a", 4, stop_token_ids=(42, 43))
    s.add_request(a)
    assert step(s, {"a": 5}).finished == []
    assert step(s, {"a": 43}).finished == ["a"]
    assert (a.status, a.stop_reason, a.output_token_ids) == (
        RequestStatus.FINISHED_STOPPED,
        43,
        [5, 43],
    )
    assert_drained(s)


def test_min_tokens_suppresses_early_stops():
    s = make()
    a = req("a", 4, min_tokens=3, stop_token_ids=(42,))
    s.add_request(a)
    assert step(s, {"a": EOS}).finished == []
    assert step(s, {"a": 42}).finished == []
    assert step(s, {"a": EOS}).finished == ["a"]
    assert a.output_token_ids == [EOS, 42, EOS]
    assert_drained(s)


def test_finish_at_max_model_len():
    s = make(max_model_len=6)
    a = req("a", 4, max_tokens=16)
    s.add_request(a)
    assert step(s).finished == []
    assert step(s).finished == ["a"]
    assert (a.status, len(a.token_ids)) == (RequestStatus.FINISHED_LENGTH, 6)
    assert_drained(s)


def test_abort_waiting_and_running_requests():
    s = make(max_num_seqs=1)
    a, b = req("a", 6), req("b", 4, first=20)
    s.add_request(a)
    s.add_request(b)
    assert step(s).scheduled == [("a", 6)]
    assert (s.kv.block_ids("a"), s.num_waiting) == ([0, 1], 1)
    assert s.abort("b") is b
    assert (b.status, s.num_waiting) == (RequestStatus.FINISHED_ABORTED, 0)
    s.check_integrity()
    assert s.abort("a") is a
    assert (a.status, s.kv.block_ids("a")) == (RequestStatus.FINISHED_ABORTED, [])
    s.check_integrity()
    assert s.abort("a") is None
    assert step(s) == Step([], [], [])
    assert_drained(s)


def test_duplicate_request_id_is_refused():
    s = make()
    s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", 4))


def test_waiting_queue_is_bounded_for_new_arrivals_only():
    kv = KVCacheManager(BlockPool(4), BS, enable_caching=True)
    s = Scheduler(SchedulerConfig(1, 64, 64, max_num_waiting=2), kv, (EOS,))
    a, b, c = req("a", 6, max_tokens=8), req("b", 6), req("c", 6)
    s.add_request(a)
    s.add_request(b)
    with pytest.raises(QueueFullError, match="max_num_waiting"):
        s.add_request(req("d", 6))  # a and b wait: full
    assert step(s).scheduled == [("a", 6)]  # a runs (one seq slot); b waits alone
    s.add_request(c)  # room again
    with pytest.raises(QueueFullError):
        s.add_request(req("e", 6))
    s.check_integrity()
    # A preempted request goes back past the bound: admitted work is never dropped.
    s._preempt(a)
    assert s.num_waiting == 3
    s.check_integrity()
    for rid in ("a", "b", "c"):
        s.abort(rid)
    assert_drained(s)


def test_a_held_request_keeps_its_place_while_others_run():
    """A request held for its tier fetch is skipped, not waited for; released, it goes
    before everything that arrived after it."""
    s = make(max_num_seqs=1)
    a, b, c = (req(r, 4, first=10 * i + 1, max_tokens=1) for i, r in enumerate("abc"))
    s.add_request(a, held=True)
    s.add_request(b)
    s.add_request(c)
    assert (s.num_waiting, s.num_held) == (3, 1)
    s.check_integrity()
    assert step(s).scheduled == [("b", 4)]  # a is held: b goes first, alone (max_num_seqs)
    assert s.release("a") is a
    assert s.release("a") is None  # released once
    assert step(s).scheduled == [("a", 4)]  # before c, which arrived after it
    assert step(s).scheduled == [("c", 4)]
    assert_drained(s)


def test_only_held_requests_leave_nothing_to_schedule():
    s = make()
    s.add_request(req("a", 4), held=True)
    assert not s.has_schedulable()
    assert step(s).scheduled == []
    aborted = s.abort("a")
    assert aborted is not None and aborted.status == RequestStatus.FINISHED_ABORTED
    assert s.release("a") is None  # gone: its late fetch is ignored
    assert_drained(s)


def test_held_requests_count_against_the_queue_bound():
    kv = KVCacheManager(BlockPool(16), BS, enable_caching=True)
    s = Scheduler(SchedulerConfig(1, 64, 64, max_num_waiting=2), kv, (EOS,))
    s.add_request(req("a", 4), held=True)
    s.add_request(req("b", 4))
    with pytest.raises(QueueFullError, match="max_num_waiting"):
        s.add_request(req("c", 4))


def test_prepare_runs_right_before_each_admission():
    """The engine's hook (which puts evicted tier blocks back) sees every request the
    scheduler is about to admit, in order, and no running one."""
    seen: list[str] = []
    kv = KVCacheManager(BlockPool(16), BS, enable_caching=True)
    s = Scheduler(
        SchedulerConfig(4, 64, 64), kv, (EOS,), prepare=lambda r: seen.append(r.request_id)
    )
    s.add_request(req("a", 4, max_tokens=2))
    s.add_request(req("b", 4, first=20, max_tokens=2))
    step(s)
    step(s)
    assert seen == ["a", "b"]


def test_a_prompt_cap_chunks_prompts_and_leaves_decodes_alone():
    # The engine's ITL target: a step computes at most `cap` prompt tokens, however much
    # budget is left, and every decoding request still gets its token each step.
    s = make(budget=64, max_model_len=64)
    s.add_request(req("a", 3, max_tokens=20))
    assert step(s).scheduled == [("a", 3)]
    assert s.num_decoding() == 1
    s.add_request(req("b", 17, first=10, max_tokens=2))
    assert step(s, cap=5).scheduled == [("a", 1), ("b", 5)]
    assert s.num_decoding() == 1  # b is catching up
    assert step(s, cap=5).scheduled == [("a", 1), ("b", 5)]
    # a waiting prompt gets nothing while the cap is spent; the decodes go on
    s.add_request(req("c", 4, first=40, max_tokens=1))
    assert step(s, cap=5).scheduled == [("a", 1), ("b", 5)]
    assert step(s, cap=5).scheduled == [("a", 1), ("b", 2), ("c", 3)]
    done = step(s, cap=5)
    assert done.scheduled == [("a", 1), ("b", 1), ("c", 1)] and done.finished == ["b", "c"]
    # no cap: the budget alone, as before
    s.add_request(req("d", 30, first=50, max_tokens=1))
    assert step(s).scheduled == [("a", 1), ("d", 30)]
