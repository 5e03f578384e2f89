"""Property-based fuzzing of the HTTP API over scripted workers: bodies from its own
`GET /openapi.json`, valid and hostile, raw bytes, wrong content types and methods. No
answer is a 5xx, every 4xx is an OpenAI error body, and afterwards a normal request is
served exactly and nothing is left admitted. (Against a launched cluster:
test_fuzz_cluster.py.) Regression cases for what it found are in test_hostile_input.py."""

from __future__ import annotations

import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from rtp_serve.core.tokenizer import Tokenizer
from tests.frontend_fakes import FakeWorker
from tests.fuzz_harness import served_frontend
from tests.fuzz_http import HttpCase, check_answer, http_cases, send
from tests.openapi_strategies import OpenAPI

TEXT = "Hello, fuzz 🙂 — done."
EOS = 0
# RTP_FUZZ_EXAMPLES: bodies per run (default 400, the suite's size); RTP_FUZZ_URL: fuzz a
# frontend already running there (served model from its /v1/models) instead of the one
# this test serves over a scripted worker, e.g. for a long run:
#   RTP_FUZZ_EXAMPLES=10000 pytest -q tests/test_fuzz_http.py
EXAMPLES = int(os.environ.get("RTP_FUZZ_EXAMPLES", "400"))
LIVE_URL = os.environ.get("RTP_FUZZ_URL")
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same cases every run: CI is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


@pytest.fixture(scope="module")
def tiny(model_dir):
    return model_dir("tiny-llama")


@pytest.fixture(scope="module")
def script(tiny) -> list[int]:
    return Tokenizer(tiny).encode(TEXT)


@pytest.fixture(scope="module")
def served(tiny, script):
    with served_frontend(tiny, FakeWorker(script, eos=EOS)) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def api(client) -> OpenAPI:
    return OpenAPI(client.get("/openapi.json").json())


def test_no_input_is_a_server_error(served, client, api, tiny, script) -> None:
    @FUZZ
    @given(case=http_cases(api, "tiny-llama"))
    def fuzz(case: HttpCase) -> None:
        check_answer(case, send(client, case))

    fuzz()
    # Still serving, exactly, and nothing of the fuzzing is left in flight.
    reply = client.post(
        "/v1/completions", json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 5}
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == Tokenizer(tiny).decode(script[:5])
    gen = served.harness.generator
    assert gen.admission.in_flight == 0 and gen.client_streams.open("127.0.0.1") == 0


@pytest.mark.skipif(LIVE_URL is None, reason="RTP_FUZZ_URL names no running frontend")
def test_no_input_is_a_server_error_on_a_running_frontend() -> None:
    with httpx.Client(base_url=LIVE_URL, timeout=120) as c:
        api = OpenAPI(c.get("/openapi.json").json())
        served_model = c.get("/v1/models").json()["data"][0]["id"]

        @FUZZ
        @given(case=http_cases(api, served_model))
        def fuzz(case: HttpCase) -> None:
            check_answer(case, send(c, case))

        fuzz()
        body = {"model": served_model, "prompt": "hi", "max_tokens": 2}
        assert c.post("/v1/completions", json=body).status_code == 200
