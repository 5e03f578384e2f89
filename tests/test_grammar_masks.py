"""Grammar masks computed beside the forward pass (engine/grammar_masks.py): the rows of a
request verifying drafts get its grammar's masks after the drafts before each; a draft the
grammar refuses leaves the rows past it unconstrained (they are never accepted); the
guide ends where it started; the worker thread's biases equal those computed on the spot."""

from __future__ import annotations

import json

import pytest
import torch

from rtp_serve.core.model_config import ModelConfig
from rtp_serve.core.sampling_params import SamplingParams
from rtp_serve.core.structured import Grammars, StructuredOutputs
from rtp_serve.engine.grammar_masks import MaskWorker, compute, entries_of
from rtp_serve.engine.request import Request
from rtp_serve.engine.spec_decode.rejection import rows_of

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def grammars(model_dir) -> Grammars:
    d = model_dir("tiny-llama")
    cfg = ModelConfig.from_dir(d)
    return Grammars(d / "tokenizer.json", cfg.vocab_size, cfg.eos_token_ids)


def _request(grammars: Grammars, rid: str = "r") -> Request:
    so = StructuredOutputs.json(SCHEMA)
    params = SamplingParams(max_tokens=20, structured=so)
    return Request(rid, [1, 2, 3], params, 4, guide=grammars.guide(so))


def _allowed(biases: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row == 0).flatten().tolist()) for row in biases]


def _one_by_one(grammars: Grammars, drafts: list[int]) -> list[set[int]]:
    """The allowed sets after each prefix of `drafts`, advancing a fresh guide."""
    request = _request(grammars, "ref")
    out = []
    for i in range(len(drafts) + 1):
        out += _allowed(compute(entries_of([request]), grammars.vocab_size))
        if i < len(drafts):
            assert request.guide.accept(drafts[i])
    return out


def test_draft_rows_get_the_grammar_after_the_drafts_before_them(grammars) -> None:
    drafts = grammars.tokenizer.tokenize_str(json.dumps({"n": 42}, separators=(",", ":")))[:4]
    request = _request(grammars)
    rows = rows_of(request, drafts)
    biases = compute(entries_of(rows), grammars.vocab_size)
    assert biases.shape == (len(drafts) + 1, grammars.vocab_size)
    assert _allowed(biases) == _one_by_one(grammars, drafts)
    assert request.guide.matcher.validate_tokens(drafts) == len(drafts)  # not advanced


def test_rows_past_a_refused_draft_are_unconstrained(grammars) -> None:
    tok = grammars.tokenizer
    good = tok.tokenize_str('{"n":')
    bad = tok.tokenize_str("x")[:1]
    drafts = good[:2] + bad + good[:1]
    request = _request(grammars)
    allowed = _allowed(compute(entries_of(rows_of(request, drafts)), grammars.vocab_size))
    assert allowed[:3] == _one_by_one(grammars, good[:2])
    assert bad[0] not in allowed[2]  # so row 2's token is never the refused draft
    everything = set(range(grammars.vocab_size))
    assert allowed[3:] == [everything, everything]


def test_worker_thread_gives_the_masks_computed_on_the_spot(grammars) -> None:
    """A batch of a constrained request with drafts, an unconstrained one, another
    constrained one: the biases come in row order, from the worker as on the spot."""
    plain = Request("free", [1, 2, 3], SamplingParams(max_tokens=5), 4)
    drafts = grammars.tokenizer.tokenize_str('{"n":1')[:2]
    rows = [*rows_of(_request(grammars, "a"), drafts), plain, _request(grammars, "b")]
    worker = MaskWorker(grammars.vocab_size)
    pending = worker.start(rows)
    assert pending is not None and pending.rows == [0, 1, 2, 4]
    # A guide is borrowed by its mask computation until it ends (the engine never touches
    # one while its step's masks are pending), so the inline reference waits for the worker.
    background = pending.biases()
    inline = MaskWorker(grammars.vocab_size, background=False).start(rows)
    assert torch.equal(background, inline.biases())
    assert worker.start([plain]) is None
