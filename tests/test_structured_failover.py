"""Failover keeps structured output: the fused worker serving a greedy `json_schema` stream is
SIGKILLed after tokens have streamed; the frontend resumes the sequence on the other worker
(prompt + tokens so far, `resume_tokens` so its grammar picks up where it was), and the client
gets one stream whose text equals the unkilled run's and validates against the schema.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.chaos import _member_of
from tests.cluster import Cluster, launch

jsonschema = pytest.importorskip("jsonschema")

# Bounded (docs/features/structured-outputs.md), yet long enough that the stream is still
# running when the kill lands: 16 strings of exactly 12 characters, ~240 characters in all
# (about 100 chunks; finding the serving worker takes what 10 of them do).
SCHEMA = {
    "type": "array",
    "items": {"type": "string", "minLength": 12, "maxLength": 12},
    "minItems": 16,
    "maxItems": 16,
}
PROMPT = "A list of sixteen twelve-letter words, as JSON:"
MAX_TOKENS = 400  # far more than the schema allows: the grammar ends the output ("stop")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory) -> Iterator[Cluster]:
    model = str(model_dir("tiny-llama"))
    with launch(model, tmp_path_factory.mktemp("structured-failover"), "--fused", "2") as c:
        yield c
    assert c.left_running == []


def _stream(cluster: Cluster, on_text: Callable[[int], None] | None = None) -> tuple[str, str]:
    """(text, finish_reason) of one streamed greedy completion under SCHEMA; `on_text(n)`
    runs after each chunk with text, n counting them."""
    with httpx.Client(base_url=cluster.url, timeout=120) as http:
        model_id = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model_id, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": True, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "words", "schema": SCHEMA, "strict": True}}}  # fmt: skip
        parts, finish = [], ""
        with http.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                choice = chunk["choices"][0]
                finish = choice.get("finish_reason") or finish
                if choice["text"]:
                    parts.append(choice["text"])
                    if on_text is not None:
                        on_text(len(parts))
    return "".join(parts), finish


def _migrations(cluster: Cluster) -> float:
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "rtp:request_migrations":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    return 0.0


def test_a_worker_killed_mid_stream_keeps_the_grammar(cluster):
    unkilled, finish = _stream(cluster)
    assert finish == "stop"  # the grammar ended it, well before max_tokens
    jsonschema.validate(json.loads(unkilled), SCHEMA)
    members = cluster.workers()
    pids = [p["pid"] for p in cluster.info["pids"] if p["name"] == "fused"]
    by_id = {m.id: pid for pid in pids if (m := _member_of(pid, members)) is not None}
    assert len(by_id) == 2, "every fused process is a registered worker"
    killed: list[str] = []

    def kill_the_serving_worker(chunks: int) -> None:
        if killed:
            return
        # Tokens have reached the client: the worker running a request now is the one
        # serving this stream (nothing else runs here).
        busy = [w for w, s in cluster.worker_stats().items() if s.num_running > 0]
        assert len(busy) == 1, f"the stream finished before the kill ({chunks} chunks)"
        os.kill(by_id[busy[0]], signal.SIGKILL)
        killed.append(busy[0])

    before = _migrations(cluster)
    text, finish = _stream(cluster, kill_the_serving_worker)
    assert killed, "no text streamed"
    assert _migrations(cluster) == before + 1  # resumed once, on the other worker
    assert (text, finish) == (unkilled, "stop")
    jsonschema.validate(json.loads(text), SCHEMA)
