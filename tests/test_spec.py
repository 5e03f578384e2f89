"""Speculative decoding (engine/spec_decode/): the proposer, the acceptance rule, the scheduler's
draft accounting, and end to end: output with speculation == without, token for token."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from rtp_serve.core.cost_model import StepCost
from rtp_serve.core.outputs import SampledToken
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.core.structured import StructuredOutputs
from rtp_serve.core.validation import InvalidRequestError
from rtp_serve.engine.block_pool import BlockPool
from rtp_serve.engine.kv_cache_manager import KVCacheManager
from rtp_serve.engine.llm_engine import LLMEngine
from rtp_serve.engine.outputs import CompletionOutput
from rtp_serve.engine.request import Request, RequestStatus
from rtp_serve.engine.sampling_noise import draw
from rtp_serve.engine.scheduler import Scheduler, SchedulerConfig
from rtp_serve.engine.spec_decode.adaptive import SpecState, best_k, draft_row_cost
from rtp_serve.engine.spec_decode.ngram import NgramProposer
from rtp_serve.engine.spec_decode.rejection import accept
from rtp_serve.engine.spec_decode.speculator import Speculator
from tests.helpers import assert_pool_idle, drive, make_llm, poison_kv

PRESET = "tiny-llama"
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(
    max_tokens=40, temperature=0.8, top_p=0.9, top_k=50, seed=123, ignore_eos=True, logprobs=2
)


def req(tokens: list[int], rid: str = "r", bs: int = 4, **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), bs)


# -- the n-gram proposer -----------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 5, 6, 7]
    (drafts,) = NgramProposer(max_n=3, min_n=2).propose([req(tokens)], [3])
    assert drafts == [3, 4, 5]  # "5 6 7" last seen at 5..7, then 3 4 5
    (short,) = NgramProposer(max_n=3, min_n=2).propose([req(tokens)], [1])
    assert short == [3]
    assert NgramProposer().propose([req([1, 2, 3, 4])], [3]) == [[]]  # no repeat: no guess


def test_ngram_reads_the_advice_first_and_in_order():
    advice = (10, 11, 12, 13, 10, 11, 14, 15)
    r = req([9, 10, 11], speculative_advice=advice)
    r.spec = SpecState(k_max=4)
    proposer = NgramProposer(max_n=2, min_n=2)
    assert proposer.propose([r], [2]) == [[12, 13]]  # the first "10 11" of the advice
    r.token_ids += [12, 13, 10, 11]
    assert proposer.propose([r], [2]) == [[14, 15]]  # from the cursor on: the second one


# -- adaptive speculation length ---------------------------------------------------------
def test_the_advice_is_a_tensor_built_once_with_the_request():
    """The proposer searches the request's tensor (not one rebuilt from the tuple each step)."""
    r = req([9, 10, 11], speculative_advice=(10, 11, 12, 13))
    assert r.advice is not None and r.advice.tolist() == [10, 11, 12, 13]
    built = r.advice
    NgramProposer().propose([r], [2])
    assert r.advice is built and req([1, 2]).advice is None


def test_an_advice_longer_than_the_context_is_refused(model_dir):
    engine = _engine(model_dir, 2)
    context = engine.limits.max_model_len
    long = replace(GREEDY, speculative_advice=(1,) * (context + 1))
    with pytest.raises(InvalidRequestError) as exc:
        engine.make_request("r", [1, 2, 3], long)
    assert exc.value.param == "speculative_advice"


def test_drafts_only_as_far_as_they_pay():
    assert best_k(0.9, 5, 0.0) == 5  # free rows: always all of them
    assert best_k(0.9, 5, 0.15) == 5
    assert best_k(0.5, 5, 0.15) == 2
    assert best_k(0.1, 5, 0.15) == 0  # a draft right one time in ten costs more than it adds
    assert best_k(0.9, 5, 0.75) == 1  # a big batch: rows are compute
    assert best_k(0.7, 5, 0.75) == 0


def test_a_request_backs_off_and_probes_again():
    state = SpecState(k_max=5)
    for _ in range(6):
        state.observe(2, 0)  # nothing accepted
    # Sits out 1, 2, then 4 steps, probing with one draft after each pause.
    assert [state.take_budget(0.15) for _ in range(10)] == [0, 1, 0, 0, 1, 0, 0, 0, 0, 1]
    for _ in range(4):
        state.observe(3, 3)
    assert state.take_budget(0.15) == 5


def test_a_request_does_not_probe_where_no_acceptance_would_pay():
    """A draft that costs about a step (a big model's pass at a big batch): even drafts
    right nine times in ten would not pay, so the request never probes; once drafts are
    cheap again it probes after its pause."""
    state = SpecState(k_max=5)
    assert [state.take_budget(0.98, gate_probes=True) for _ in range(12)] == [0] * 12
    # Nor where such drafts would pay only a little (k=1 at alpha 0.9: 1.9 / 1.85 = 1.03):
    # drafts that are not that good would make it a loss.
    assert [state.take_budget(0.85, gate_probes=True) for _ in range(12)] == [0] * 12
    assert 1 in [state.take_budget(0.15, gate_probes=True) for _ in range(16)]
    # An n-gram proposer's price is only timed on its calls: ungated, it probes at any price
    # (one slow call must not stop its requests for good).
    state = SpecState(k_max=5)
    assert [state.take_budget(0.98) for _ in range(4)] == [0, 1, 0, 0]


def test_a_draft_rows_cost_from_the_fitted_step_time():
    assert draft_row_cost(StepCost(), 1) == pytest.approx(0.2 / 1.2)  # the prior, unfitted
    step = StepCost(fixed_s=0.060, token_s=0.001, row_s=0.010)
    assert draft_row_cost(step, 1) == pytest.approx(1 / 7)
    assert draft_row_cost(step, 16) == pytest.approx(16 / 22)
    # A draft model's own pass (20 ms for the batch) on top of the row: 1/7 + 20/70.
    assert draft_row_cost(step, 1, draft_pass_s=0.020) == pytest.approx(1 / 7 + 2 / 7)
    # Fitted on prompt tokens alone (the decode terms held at 0): no decode step to price the
    # draft's pass against, so only the prior row cost counts (this divided by zero once).
    prompts_only = StepCost(token_s=0.001)
    assert draft_row_cost(prompts_only, 1, draft_pass_s=0.020) == pytest.approx(0.2 / 1.2)
    assert [best_k(0.5, 5, beta) for beta in (1 / 7, 3 / 7, 1.0)] == [2, 1, 0]
    # A draft model's guess of its pass (a quarter of the target's weights) until a pass of
    # it is timed and the step is fitted; then the timing.
    assert draft_row_cost(StepCost(), 1, pass_ratio_prior=0.25) == pytest.approx(0.2 / 1.2 + 0.25)
    assert draft_row_cost(step, 1, 0.020, pass_ratio_prior=0.25) == pytest.approx(1 / 7 + 2 / 7)
    # A timed pass far above the prior (the process was paused meanwhile) counts as twice it.
    assert draft_row_cost(step, 1, 0.700, pass_ratio_prior=0.25) == pytest.approx(1 / 7 + 0.5)


def test_a_proposer_whose_passes_cost_more_than_they_add_stops_drafting():
    """The speculator times the proposer (a scripted clock: 120 ms a call, two drafts a
    call); with that in the price, a request right half the time stops drafting."""
    ticks = iter([0.0, 0.120, 1.0, 1.120])
    spec = Speculator(NgramProposer(max_n=2, min_n=2), 5, 64, clock=lambda: next(ticks))
    step = StepCost(fixed_s=0.060, token_s=0.001, row_s=0.010)
    r = req([1, 2, 3, 1, 2, 3, 1, 2], max_tokens=30)
    r.num_computed_tokens = len(r.token_ids) - 1
    r.status = RequestStatus.RUNNING
    spec.propose([r], step)
    assert r.spec_token_ids == [3, 1]  # alpha 1/2 and only the row's cost: k = 2
    assert spec.pass_s == pytest.approx(0.060)  # 120 ms for two passes
    spec.propose([r], step)
    assert r.spec_token_ids == []  # the same request, the pass priced in: k = 0


# -- the acceptance rule -----------------------------------------------------------------
def test_accept_keeps_the_agreeing_prefix_plus_the_targets_token():
    sampled = [SampledToken(t) for t in (7, 8, 9, 4)]
    assert [t.token_id for t in accept([7, 8, 5], sampled)] == [7, 8, 9]
    assert [t.token_id for t in accept([1, 8, 9], sampled)] == [7]
    assert [t.token_id for t in accept([7, 8, 9], sampled)] == [7, 8, 9, 4]


def test_accepted_tokens_follow_the_target_distribution():
    """The rule on a 5-token vocabulary over many seeds: the first token emitted is p0's
    (chi-square), a draft is accepted with probability p0(d), and after an accepted draft
    the next token is p1's: the standard rejection rule's law, for a deterministic draft."""
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    p1 = torch.tensor([0.3, 0.05, 0.05, 0.5, 0.1])
    d = [1, 3]
    n = 6000
    first, second = Counter(), Counter()
    accepted_first = 0
    for seed in range(n):
        sampled = [SampledToken(draw(p, seed, 100 + i)) for i, p in enumerate((p0, p1, p0))]
        out = [t.token_id for t in accept(d, sampled)]
        first[out[0]] += 1
        if out[0] == d[0]:
            accepted_first += 1
            second[out[1]] += 1
    assert abs(accepted_first / n - float(p0[d[0]])) < 0.02
    assert _chi2(first, p0, n) < 18.5  # 4 degrees of freedom: p < 0.001 if the law were p0
    assert _chi2(second, p1, accepted_first) < 18.5


def _chi2(counts: Counter, p: torch.Tensor, n: int) -> float:
    return sum((counts[i] - n * float(p[i])) ** 2 / (n * float(p[i])) for i in range(len(p)))


def test_draws_are_keyed_by_seed_and_position_alone():
    probs = torch.full((50,), 1 / 50)
    assert draw(probs, 7, 3) == draw(probs.clone(), 7, 3)
    assert len({draw(probs, 7, pos) for pos in range(40)}) > 10
    assert len({draw(probs, seed, 3) for seed in range(40)}) > 10


def test_draws_follow_the_distribution_and_never_take_a_zero():
    """Inverse-CDF draws over seeds: the law of `probs` (chi-square), never a token of
    probability zero (one inside the vocabulary, one at its end)."""
    probs = torch.tensor([0.5, 0.0, 0.25, 0.125, 0.125, 0.0])
    n = 4000
    counts = Counter(draw(probs, seed, 11) for seed in range(n))
    assert counts[1] == counts[5] == 0
    nonzero = [0, 2, 3, 4]
    chi2 = sum((counts[i] - n * float(probs[i])) ** 2 / (n * float(probs[i])) for i in nonzero)
    assert chi2 < 16.3  # 3 degrees of freedom: p < 0.001 if the law were probs


# -- the scheduler's accounting of drafts ------------------------------------------------
def test_drafts_are_scheduled_then_rejected_ones_released_exactly():
    kv = KVCacheManager(BlockPool(8), 4)
    s = Scheduler(SchedulerConfig(4, 64, 64), kv, (0,))
    r = req([1, 2, 3], max_tokens=10)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {"r": [SampledToken(50)]})
    assert (len(r.token_ids), r.num_computed_tokens, kv.block_ids("r")) == (4, 3, [0])
    r.spec_token_ids = [60, 61, 62, 63, 64]
    out = s.schedule()
    [item] = out.scheduled
    assert (item.num_new_tokens, item.spec_token_ids, item.samples) == (
        6,
        [60, 61, 62, 63, 64],
        True,
    )
    assert kv.block_ids("r") == [0, 1, 2]  # room for 3 + 6 tokens
    assert r.spec_token_ids == []  # taken by this step
    # The target agrees with 60, then says 70: two tokens, one draft's KV kept.
    advanced, _ = s.update_from_output(out, {"r": [SampledToken(60), SampledToken(70)]})
    assert [t.token_id for t in advanced[0][1]] == [60, 70]
    assert r.token_ids == [1, 2, 3, 50, 60, 70]
    assert r.num_computed_tokens == 5  # 3 + the last token + one accepted draft
    assert kv.block_ids("r") == [0, 1]  # block 2 held only rejected drafts
    assert kv.pool.free_queue_ids()[-1] == 2
    s.check_integrity()


def test_drafts_are_trimmed_to_the_step_budget():
    s = Scheduler(SchedulerConfig(4, 3, 64), KVCacheManager(BlockPool(8), 4), (0,))
    a = req([1, 2, 3], "a", max_tokens=10)
    s.add_request(a)
    s.update_from_output(s.schedule(), {"a": [SampledToken(9)]})
    a.spec_token_ids = [1, 2, 3, 4]
    [item] = s.schedule().scheduled  # budget 3: the last token and two drafts
    assert (item.num_new_tokens, item.spec_token_ids) == (3, [1, 2])


def test_drafts_are_dropped_rather_than_preempt_anyone():
    s = Scheduler(SchedulerConfig(4, 64, 64), KVCacheManager(BlockPool(3), 4), (0,))
    a = req([1, 2, 3], "a", max_tokens=10)
    s.add_request(a)
    s.add_request(req([5, 6, 7, 8, 9], "b", max_tokens=10))
    s.update_from_output(s.schedule(), {"a": [SampledToken(4)], "b": [SampledToken(4)]})
    assert s.kv.pool.num_free_blocks == 0  # a's block has room for its last token only
    a.spec_token_ids = [7, 7, 7]
    out = s.schedule()
    scheduled = [(i.request.request_id, i.num_new_tokens, i.spec_token_ids) for i in out.scheduled]
    assert scheduled == [("a", 1, []), ("b", 1, [])]
    assert out.preempted == []
    s.check_integrity()


# -- end to end on the tiny preset --------------------------------------------------------
def _engine(
    model_dir, spec_k: int | None, method: str = "ngram", adaptive: bool = True, **args
) -> LLMEngine:
    """A draft model speculates at full k every step (adaptive off): on these tiny models
    its pass costs about what the target's does, so adaptive k would rightly never draft,
    and these tests are about what drafting does to the output, KV and pools. `adaptive`
    False does the same for n-gram drafts, where a test needs every row to draft."""
    if spec_k is not None:
        args |= {"speculative": method, "num_speculative_tokens": spec_k}
    engine = make_llm(model_dir(PRESET), **args).engine
    if spec_k is not None and (method == "draft" or not adaptive):
        engine.speculator.adaptive = False
    return engine


def _run(
    engine: LLMEngine,
    prompts: Sequence[list[int]],
    params: SamplingParams | list[SamplingParams],
    arrivals_at: list[int] | None = None,
    made: list[Request] | None = None,
) -> list[CompletionOutput]:
    """Outputs in prompt order; integrity checked after every step, streamed deltas joined
    equal to the whole. `made` collects the requests."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    pairs = zip(prompts, params, strict=True)
    reqs = [engine.make_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(pairs)]
    if made is not None:
        made.extend(reqs)
    at = arrivals_at or [0] * len(reqs)
    arrivals: dict[int, list[Request]] = {}
    for r, step in zip(reqs, at, strict=True):
        arrivals.setdefault(step, []).append(r)
    final, streamed = drive(engine, arrivals)
    for rid, out in final.items():
        assert streamed[rid] == out.token_ids
    return [final[f"r{i}"] for i in range(len(reqs))]


@pytest.fixture(scope="module")
def spec_prompts(corpus_ids) -> list[list[int]]:
    """Prompts that repeat themselves (where n-grams match), and some that do not."""
    code = corpus_ids[:40]
    return [code + code[:20], corpus_ids[60:100] * 2, corpus_ids[100:130], code[:12]]


@pytest.fixture(scope="module")
def reference(model_dir, spec_prompts):
    """Greedy and seeded outputs without speculation."""
    engine = _engine(model_dir, None)
    return _run(engine, spec_prompts, GREEDY), _run(engine, spec_prompts, SEEDED)


def _advised(params: SamplingParams, output: list[int], every: int = 0) -> SamplingParams:
    """`params` with the expected output as advice; with `every`, one token in that many
    is wrong (the draft is rejected there and speculation resumes after)."""
    advice = [t + 1 if every and i % every == every - 1 else t for i, t in enumerate(output)]
    return replace(params, speculative_advice=tuple(advice))


def _mixed(params: SamplingParams, refs: list[CompletionOutput]) -> list[SamplingParams]:
    """A batch of every kind: exact advice, advice with errors, speculation off, n-gram."""
    return [
        _advised(params, refs[0].token_ids),
        _advised(params, refs[1].token_ids, every=7),
        replace(params, num_speculative_tokens=0),
        params,
    ]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_equals_no_speculation(model_dir, spec_prompts, reference, k):
    engine = _engine(model_dir, k)
    outs = _run(engine, spec_prompts, _mixed(GREEDY, reference[0]))
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference[0]]
    stats = engine.stats().spec
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert max(i for i, p in enumerate(stats.proposed_per_pos) if p) < k
    assert_pool_idle(engine)


def test_greedy_equals_hf(model_dir, spec_prompts, hf_greedy):
    engine = _engine(model_dir, 3)
    want = hf_greedy(PRESET, spec_prompts[0], 24)[0]
    [out] = _run(engine, spec_prompts[:1], _advised(replace(GREEDY, max_tokens=24), want, 5))
    assert out.token_ids == want
    assert engine.stats().spec.num_accepted_tokens > 0


def test_seeded_sampling_equals_no_speculation(model_dir, spec_prompts, reference):
    """Same seed, same tokens, same logprobs: draws are keyed by (seed, position)."""
    engine = _engine(model_dir, 4)
    outs = _run(engine, spec_prompts, _mixed(SEEDED, reference[1]))
    for got, want in zip(outs, reference[1], strict=True):
        assert got.token_ids == want.token_ids
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.top.keys() == b.top.keys()
            assert math.isclose(a.logprob, b.logprob, rel_tol=1e-4, abs_tol=1e-4)
    assert engine.stats().spec.num_accepted_tokens > 0
    assert_pool_idle(engine)


def test_a_draft_rows_penalties_count_the_drafts_before_it():
    """Row i of a verification stands after drafts 1..i: presence, frequency and repetition
    penalties count those drafts as output tokens (as they will be if accepted)."""
    from rtp_serve.engine.logits_processors import process_logits
    from rtp_serve.engine.spec_decode.rejection import rows_of

    r = req([1, 2, 3], frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=2.0)
    r.append_token(7)  # one output token so far
    rows = rows_of(r, [5, 5, 9])
    out = process_logits(torch.ones(len(rows), 12), rows)
    # Row 0 is the request itself, row i stands after drafts 1..i. Token 5: once before
    # row 1, twice before rows 2 and 3; 7 in every row; 9 before row 3 only; prompt tokens
    # only repetition-penalised (1 / 2).
    f, p = 1.0, 0.5
    assert out[:, 5].tolist() == [1.0, 0.5 - f - p, 0.5 - 2 * f - p, 0.5 - 2 * f - p]
    assert out[:, 7].tolist() == [0.5 - f - p] * 4
    assert out[:, 9].tolist() == [1.0, 1.0, 1.0, 0.5 - f - p]
    assert out[:, 1].tolist() == [0.5] * 4
    assert out[:, 0].tolist() == [1.0] * 4


def test_penalised_output_is_the_same_with_speculation(model_dir, spec_prompts):
    params = replace(
        GREEDY, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
        logit_bias=((spec_prompts[0][3], 2.0),),
    )  # fmt: skip
    want = _run(_engine(model_dir, None), spec_prompts, params)
    engine = _engine(model_dir, 3)
    got = _run(engine, spec_prompts, _mixed(params, want))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.stats().spec.num_accepted_tokens > 0
    assert_pool_idle(engine)


def test_stops_mid_draft(model_dir, spec_prompts, reference):
    """max_tokens, a stop token and min_tokens cut inside a verified draft as without one."""
    ref = reference[0][0].token_ids
    stop = ref[9]
    params = [
        _advised(p, ref)
        for p in (
            replace(GREEDY, max_tokens=7),
            replace(GREEDY, stop_token_ids=(stop,), ignore_eos=False),
            replace(GREEDY, stop_token_ids=(stop,), min_tokens=12, max_tokens=14),
        )
    ]
    base = _run(_engine(model_dir, None), [spec_prompts[0]] * 3, params)
    engine = _engine(model_dir, 5)
    outs = _run(engine, [spec_prompts[0]] * 3, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in base]
    assert len(outs[0].token_ids) == 7
    assert outs[1].token_ids[-1] == stop and outs[1].stop_reason == stop
    assert_pool_idle(engine)


class WrongProposer:
    """Drafts that are mostly wrong: the last token + 1, + 2, ... (the target rarely agrees)."""

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[list[int]]:
        pairs = zip(requests, budgets, strict=True)
        return [[(r.token_ids[-1] + 1 + i) % 256 for i in range(k)] for r, k in pairs]

    def release(self, request_id: str) -> None:
        pass

    def check_integrity(self) -> None:
        pass


def test_rejected_kv_is_never_read(model_dir, spec_prompts, reference):
    """Every draft is (almost always) wrong, over a poisoned cache: if rejected drafts' KV
    were ever attended to, or a block holding it were cached, the outputs would differ.
    The second round hits the first round's blocks in the prefix cache."""
    engine = _engine(model_dir, 4)
    engine.speculator = Speculator(WrongProposer(), 4, engine.limits.max_model_len, adaptive=False)
    outs = _run(engine, spec_prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference[0]]
    stats = engine.stats().spec
    assert stats.num_draft_tokens > 400  # 4 a step
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    # Prompts that run through the first round's outputs: prefix hits on its blocks.
    longer = [p + o.token_ids[:-3] for p, o in zip(spec_prompts, outs, strict=True)]
    base = _run(_engine(model_dir, None), longer, replace(GREEDY, max_tokens=8))
    again = _run(engine, longer, replace(GREEDY, max_tokens=8))
    assert all(o.num_cached_tokens > 0 for o in again)
    assert [o.token_ids for o in again] == [o.token_ids for o in base]
    assert_pool_idle(engine)


def test_preemption_chunked_prefill_and_prefix_hits(model_dir, spec_prompts, reference):
    """A pool too small for the batch (requests are preempted and recomputed) and a step
    budget that chunks prompts and trims drafts; arrivals over several steps."""
    args = {"num_kv_blocks": 16, "max_num_batched_tokens": 24}
    prompts = spec_prompts + spec_prompts[:2]
    at = [0, 0, 1, 2, 6, 9]
    params = _mixed(GREEDY, reference[0]) + [_advised(GREEDY, reference[0][0].token_ids)] * 2
    base = _run(_engine(model_dir, None, **args), prompts, params, at)
    engine = _engine(model_dir, 3, **args)
    made: list[Request] = []
    outs = _run(engine, prompts, params, at, made)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert [o.token_ids for o in outs[:4]] == [o.token_ids for o in reference[0]]
    assert any(o.num_cached_tokens > 0 for o in outs[4:])
    assert sum(r.num_preemptions for r in made) > 0
    assert engine.stats().spec.num_accepted_tokens > 0
    assert_pool_idle(engine)


@pytest.mark.parametrize("every", [0, 3], ids=["exact", "wrong-every-3"])
def test_rows_with_a_grammar_speculate_within_it(model_dir, spec_prompts, every):
    """Drafts (advice, some of it breaking the grammar) are cut at the first token the
    grammar refuses, the rest verified under the grammar's masks after the drafts before
    them: the same tokens as without speculation, beside an unconstrained row. Adaptive k
    off: the output is a few tokens long, and with the cost model's price at batch 2 a row
    whose first drafts were refused could sit out all of it (seen in CI)."""
    regex = StructuredOutputs.regex("(ab|cd|[0-9]){3,12}")
    params = SamplingParams(max_tokens=30, temperature=0.0, structured=regex)
    prompts = spec_prompts[:2]
    base = _run(_engine(model_dir, None), prompts, [params, GREEDY])
    engine = _engine(model_dir, 3, adaptive=False)
    advised = _advised(params, base[0].token_ids, every)
    made: list[Request] = []
    outs = _run(engine, prompts, [advised, _advised(GREEDY, base[1].token_ids)], made=made)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    text = engine.tokenizer.decode(outs[0].token_ids)
    assert re.fullmatch("(ab|cd|[0-9]){3,12}", text), text
    state = made[0].spec  # the grammar row's drafts were verified (and right, when exact)
    assert state is not None and state.tried > 0 and (every or state.accepted > 0)
    assert_pool_idle(engine)


def test_remote_prefill_then_speculative_decode(model_dir, spec_prompts, reference):
    """PD: a prefill engine's KV and first token, then a decode engine that speculates."""
    pre = _engine(model_dir, None)
    dec = _engine(model_dir, 3)
    poison_kv(dec)
    prompt = spec_prompts[0]
    first_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    pre.add_request(pre.make_request("p", prompt, first_params, export_kv_from=0))
    first = drive(pre, {})[0]["p"]
    assert first.prompt_kv is not None
    params = _advised(GREEDY, reference[0][0].token_ids, every=9)
    dec.add_request(dec.make_request("p", prompt, params, remote_prefill=True))
    [waiting] = dec.step()
    assert waiting.waiting_for_kv
    out = dec.write_remote_kv("p", [first.prompt_kv], SampledToken(first.token_ids[0]))
    assert dec.scheduler.requests["p"].params.speculative_advice
    assert out.new_token_ids == first.token_ids
    final, _ = drive(dec, {})  # the output so far joined with the rest
    assert final["p"].token_ids == reference[0][0].token_ids
    assert dec.stats().spec.num_accepted_tokens > 0
    assert_pool_idle(dec)


def test_speculator_limits_drafts_to_what_the_request_may_still_produce():
    spec = Speculator(NgramProposer(max_n=2, min_n=2), 5, max_model_len=64)
    r = req([1, 2, 3, 1, 2, 3, 1, 2], max_tokens=3)
    r.num_computed_tokens = len(r.token_ids) - 1
    r.status = RequestStatus.RUNNING
    spec.propose([r], StepCost())
    assert r.spec_token_ids == [3, 1]  # 3 tokens to go: two drafts and the target's own
    r.params = replace(r.params, num_speculative_tokens=0)
    spec.propose([r], StepCost())
    assert r.spec_token_ids == []


# -- what the worker exports --------------------------------------------------------------
def test_worker_metrics_count_what_is_new():
    from prometheus_client import CollectorRegistry

    from rtp_serve.engine.spec_decode.stats import SpecStats
    from rtp_serve.services.worker.metrics import WorkerFamilies, WorkerMetrics

    registry = CollectorRegistry()
    m = WorkerMetrics(WorkerFamilies(registry), "decode", "m")
    stats = SpecStats(4)
    stats.observe(3, 2)
    stats.observe(2, 0)
    m.spec_decode(stats.snapshot())
    stats.observe(4, 4)
    m.spec_decode(stats.snapshot())
    m.spec_decode(stats.snapshot())  # nothing new: nothing counted twice

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"role": "decode", "model_name": "m"} | labels)

    assert value("rtp:spec_decode_num_drafts_total") == 3
    assert value("rtp:spec_decode_num_draft_tokens_total") == 9
    assert value("rtp:spec_decode_num_accepted_tokens_total") == 6
    per_pos = [
        value("rtp:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(4)
    ]
    assert per_pos == [2, 2, 1, 1]
    rates = [value("rtp:spec_decode_acceptance_rate_per_pos", position=str(i)) for i in range(4)]
    assert rates == [2 / 3, 2 / 3, 1 / 2, 1 / 1]
    assert value("rtp:spec_decode_mean_accepted_length") == 1 + 6 / 3


def test_worker_flags_build_the_engine_config(model_dir):
    import argparse

    from rtp_serve.services.worker.config import add_worker_arguments, engine_config

    p = argparse.ArgumentParser()
    add_worker_arguments(p)
    base = ["--model", str(model_dir(PRESET)), "--kv-cache-mib", "8"]
    config = engine_config(
        p.parse_args([*base, "--speculative", "ngram", "--num-speculative-tokens", "4"])
    )
    assert (config.speculative, config.num_speculative_tokens) == ("ngram", 4)
    assert engine_config(p.parse_args(base)).speculative is None
    with pytest.raises(SystemExit):
        p.parse_args([*base, "--speculative", "medusa"])
    draft = engine_config(p.parse_args([*base, "--speculative", "draft", "--draft-layers", "2"]))
    assert (draft.speculative, draft.draft_model, draft.draft_num_layers) == ("draft", None, 2)


# -- the real model -----------------------------------------------------------------------
def test_smollm2_greedy_equals_no_speculation(smollm2):
    """An edit-style prompt (advice: the code it repeats), plain n-gram on a chat question,
    and a request that does not speculate, in one batch."""
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    base = make_llm(smollm2, num_kv_blocks=64).engine
    tok = base.tokenizer

    def chat(text: str) -> list[int]:
        t = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tok.encode(t, add_special_tokens=False)

    prompts = [
        chat(f"Add type hints to this code. Reply with the code only.\n\n{code}"),
        chat("List the days of the week, then list them again."),
        chat("What is the capital of France?"),
    ]
    greedy = SamplingParams(max_tokens=48, temperature=0.0)
    advice = tuple(tok.encode(code, add_special_tokens=False))
    params = [
        replace(greedy, speculative_advice=advice),
        greedy,
        replace(greedy, num_speculative_tokens=0),
    ]
    want = _run(base, prompts, params)
    engine = make_llm(
        smollm2, num_kv_blocks=64, speculative="ngram", num_speculative_tokens=3
    ).engine
    got = _run(engine, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = engine.stats().spec
    assert stats.num_accepted_tokens > 10, stats
    assert_pool_idle(engine)


# -- the draft-model proposer -----------------------------------------------------------------
# The target as its own draft (all its layers) must always be right, greedily: any KV the
# draft side lost or kept wrongly across accepted and rejected drafts shows as a rejection.
# Its first layer alone is the built-in truncated draft: mostly wrong on a random model, so
# the rollback runs constantly; the output must not care either way.
DRAFTS = {"whole target": {"draft_num_layers": 4}, "first layer": {"draft_num_layers": 1}}


@pytest.mark.parametrize(
    ("draft", "k"),
    [("whole target", 1), ("whole target", 3), ("whole target", 5), ("first layer", 3)],
)
def test_draft_model_greedy_equals_no_speculation(model_dir, spec_prompts, reference, k, draft):
    engine = _engine(model_dir, k, "draft", **DRAFTS[draft])
    params = [GREEDY, GREEDY, replace(GREEDY, num_speculative_tokens=0), GREEDY]
    outs = _run(engine, spec_prompts, params)  # integrity (the draft's pool too) every step
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference[0]]
    stats = engine.stats().spec
    assert stats.num_draft_tokens > 0
    if draft == "whole target":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert_pool_idle(engine)
    proposer = engine.speculator.proposer
    # Its price: the target's weights, or its first layer's share; then its timed passes.
    assert (proposer.timer.prior == 1.0) == (draft == "whole target") and proposer.timer.prior > 0
    assert proposer.timer.pass_s > 0
    assert proposer._shadows == {}  # every shadow released with its request
    assert proposer.kv.pool.num_free_blocks == proposer.kv.pool.num_blocks


def test_a_draft_of_the_targets_layers_copies_their_kv_instead_of_computing_it(
    model_dir, spec_prompts, reference
):
    """Its shadows take the target's KV of what the target computed: every draft pass
    computes one token a request (the prompt is never run through the draft), and the
    drafts are still all right (the whole target drafting: any wrong KV would show)."""
    engine = _engine(model_dir, 3, "draft", **DRAFTS["whole target"])
    runner = engine.speculator.proposer.runner
    rows: list[int] = []
    execute = runner.execute

    def counting(sched, tables):
        rows.extend(s.num_new_tokens for s in sched.scheduled)
        return execute(sched, tables)

    runner.execute = counting
    outs = _run(engine, spec_prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference[0]]
    stats = engine.stats().spec
    assert 0 < stats.num_accepted_tokens == stats.num_draft_tokens
    assert rows and set(rows) == {1}


@pytest.mark.parametrize("draft", list(DRAFTS))
def test_draft_model_seeded_sampling_equals_no_speculation(
    model_dir, spec_prompts, reference, draft
):
    engine = _engine(model_dir, 3, "draft", **DRAFTS[draft])
    outs = _run(engine, spec_prompts, SEEDED)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference[1]]
    assert engine.stats().spec.num_draft_tokens > 0


def test_draft_model_under_preemption_a_small_draft_pool_and_arrivals(
    model_dir, spec_prompts, reference
):
    """The target pool is too small (preemption, recompute) and so is the draft's (its
    shadows are dropped and rebuilt); prompts chunk; requests arrive over several steps."""
    args = {"num_kv_blocks": 16, "max_num_batched_tokens": 24, "draft_num_layers": 4}
    prompts = spec_prompts + spec_prompts[:2]
    at = [0, 0, 1, 2, 6, 9]
    base = _run(
        _engine(model_dir, None, num_kv_blocks=16, max_num_batched_tokens=24), prompts, GREEDY, at
    )
    engine = _engine(model_dir, 3, "draft", **args)
    made: list[Request] = []
    outs = _run(engine, prompts, GREEDY, at, made)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert sum(r.num_preemptions for r in made) > 0
    stats = engine.stats().spec
    assert 0 < stats.num_accepted_tokens == stats.num_draft_tokens
    assert_pool_idle(engine)


def test_another_model_drafts_and_the_output_is_still_the_targets(
    model_dir, spec_prompts, reference
):
    # tiny-mistral: another model (other weights) over the same vocabulary.
    engine = _engine(model_dir, 3, "draft", draft_model=str(model_dir("tiny-mistral")))
    assert engine.speculator.proposer.model_config.architecture == "MistralForCausalLM"
    outs = _run(engine, spec_prompts[:2], GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference[0][:2]]
    assert engine.stats().spec.num_draft_tokens > 0


def test_draft_model_settings_are_checked(model_dir, tmp_path):
    other = tmp_path / "other-vocab"
    other.mkdir()
    config = json.loads((model_dir("tiny-mistral") / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"vocab_size": 9000}))
    with pytest.raises(ValueError, match="same tokenizer"):
        _engine(model_dir, 3, "draft", draft_model=str(other))
    with pytest.raises(ValueError, match="draft layers must be in"):
        _engine(model_dir, 3, "draft", draft_num_layers=9)
    with pytest.raises(ValueError, match='need speculative="draft"'):
        _engine(model_dir, 3, "ngram", draft_num_layers=1)
