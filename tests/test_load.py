"""Serving under load, on a real PD cluster (1 prefill, 2 decode workers, 2 sequences each):
the wait estimate in the load reports, per-request deadlines, and graceful stops (one
decode worker, then the whole launcher) while streams run.

The tests run in order and the last one stops the cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from rtp_serve.engine import LLM, SamplingParams
from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import events_pb2, nameservice_pb2
from rtp_serve.services.launcher.process import alive
from tests.cluster import launch
from tests.test_metrics import names, scrape

DRAIN_S = 1.5
PROMPTS = [f"def task_{i}(items):\n    # step {i}: sort, then count" for i in range(8)]
LONG = 400  # tokens: far more than a drained worker finishes in DRAIN_S


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return str(model_dir("tiny-llama"))


def _launch(model, tmp_path_factory):
    flags = ("--prefill", "1", "--decode", "2", "--max-num-seqs", "2")
    return launch(model, tmp_path_factory.mktemp("load"), *flags, "--drain-timeout", str(DRAIN_S))


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    with _launch(model, tmp_path_factory) as c:
        yield c


@pytest.fixture(scope="module")
def reference(model) -> list[str]:
    """Greedy text of each prompt, LONG tokens, from the in-process engine."""
    llm = LLM(model, num_kv_blocks=512)
    params = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
    return [out.text for out in llm.generate(PROMPTS, params)]


def body(prompt: str, max_tokens: int = LONG, **extra) -> dict:
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}  # fmt: skip


def decode_pids(cluster) -> list[int]:
    return [p["pid"] for p in cluster.info["pids"] if p["name"] == "decode"]


async def stream_text(http: httpx.AsyncClient, payload: dict, started: asyncio.Event | None):
    """The text of a streamed completion; sets `started` at its first chunk."""
    text = []
    async with http.stream("POST", "/v1/completions", json={**payload, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text.append(chunk["choices"][0]["text"])
            if started is not None:
                started.set()
    return "".join(text)


async def running(cluster) -> int:
    stats = await asyncio.to_thread(cluster.worker_stats)
    return sum(s.num_running for s in stats.values())


async def waiting(cluster) -> int:
    stats = await asyncio.to_thread(cluster.worker_stats)
    return sum(s.num_waiting for s in stats.values())


def assert_clean(cluster) -> None:
    for worker_id, s in cluster.wait_idle().items():
        assert s.integrity_ok, (worker_id, s.integrity_error)
        assert (s.held_blocks, s.num_waiting, s.num_running) == (0, 0, 0), (worker_id, s)


def test_load_report_and_stats_carry_the_wait_estimate(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
    for prompt in PROMPTS[:3]:  # some steps on every worker kind, so rates are measured
        client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8)
    # Idle first: a step that ends after a worker's report would refit its cost model, and
    # its stats below would no longer match that report.
    cluster.wait_idle()
    reports: dict[str, events_pb2.LoadReport] = {}
    roles = {m.id: m.role for m in cluster.workers()}

    async def collect():
        bus = await Bus.connect(cluster.info["nats"], "test-load")

        async def keep(msg: events_pb2.LoadReport, headers) -> None:
            reports[msg.worker_id] = msg

        await bus.subscribe(subjects.load_report_all(), events_pb2.LoadReport, keep)
        deadline = time.monotonic() + 10  # reports come every 0.25 s
        while set(reports) != set(roles) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await bus.close()

    asyncio.run(collect())
    assert set(reports) == set(roles)
    for worker_id, report in reports.items():
        assert report.max_num_waiting == 256  # the workers' default
        assert report.max_num_seqs == 2  # the cluster's --max-num-seqs
        assert report.queue_wait_s >= 0 and report.num_waiting == 0
        if roles[worker_id] == nameservice_pb2.ROLE_PREFILL:
            assert report.prefill_tokens_per_s > 0  # it computed the prompts
    assert any(r.decode_step_s > 0 for r in reports.values())  # the decode side decoded
    stats = cluster.worker_stats()
    for worker_id, s in stats.items():
        assert s.max_num_waiting == 256
        assert s.prefill_tokens_per_s == pytest.approx(reports[worker_id].prefill_tokens_per_s)
    member = next(m for m in cluster.workers() if m.role == nameservice_pb2.ROLE_PREFILL)
    exposed = names(scrape(member.metrics_address))
    assert {"rtp:queue_wait_estimate_seconds", "rtp:prefill_throughput_tokens_per_second"} <= (
        exposed
    )


def test_deadline_passing_in_the_queue_is_504_and_leaves_nothing_held(cluster):
    """Six long streams fill both decode workers' batches (2 + 2) and queues; a request
    with a 0.5 s timeout queues behind them and is answered 504 naming the timeout; no
    worker keeps it. (A stream that runs to its end while the others are still queued, as
    on a busy machine, is started again.)"""
    # A queued stream's first byte waits for a long stream ahead of it to end (on a loaded
    # machine that took 60 s once): the reads wait as long as the loop's deadline below.
    timeout = httpx.Timeout(60, read=180)

    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=timeout) as http:
            started = [asyncio.Event() for _ in range(6)]

            def long_stream(i: int) -> asyncio.Task:
                return asyncio.create_task(stream_text(http, body(PROMPTS[i], 1900), started[i]))

            busy = [long_stream(i) for i in range(6)]
            deadline = time.monotonic() + 120  # a slow machine is slow, not stuck
            # Until both extras queue at a decode worker (one may still be in its prefill or
            # its KV transfer when the batches are first full).
            while (
                await running(cluster) < 4
                or sum(e.is_set() for e in started) < 4
                or await waiting(cluster) < 2
            ):
                assert time.monotonic() < deadline, "the long streams never filled the batches"
                for i, task in enumerate(busy):
                    if task.done():  # it ran to its end while others were queued: again
                        task.result()  # (a failed one fails the test)
                        started[i].clear()
                        busy[i] = long_stream(i)
                await asyncio.sleep(0.05)
            reply = await http.post("/v1/completions", json=body(PROMPTS[5], 8, timeout=0.5))
            stats = await asyncio.to_thread(cluster.worker_stats)
            queued = {w: s.num_waiting for w, s in stats.items()}
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            return reply, queued

    reply, queued = asyncio.run(main())
    assert reply.status_code == 504, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "timeout_error",
        "timeout",
        "request_timeout",
    )
    assert "timeout of 0.5 s" in error["message"]
    assert sum(queued.values()) == 2  # the two long extras; the expired one left at once
    assert_clean(cluster)


def test_deadline_passing_while_generating_ends_with_length(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(
        model="tiny-llama",
        prompt=PROMPTS[0],
        max_tokens=1900,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "timeout": 1.0},
    )
    chunks = list(stream)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert 0 < chunks[-1].usage.completion_tokens < 1900
    assert_clean(cluster)


def test_sigterm_to_a_decode_worker_under_load_loses_no_stream(cluster, reference):
    """Eight greedy streams over both decode workers; one gets SIGTERM: it leaves the
    nameservice, finishes what it can in its drain timeout, ends the rest (which the
    frontend resumes on the other worker) and exits. Every text equals the reference."""
    victim = decode_pids(cluster)[0]
    exited_after: list[float] = []

    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
            started = [asyncio.Event() for _ in PROMPTS]
            streams = [
                asyncio.create_task(stream_text(http, body(p), e))
                for p, e in zip(PROMPTS, started, strict=True)
            ]
            # Four run (two on each worker), four wait for a slot: which four is the
            # workers' order of arrival, not the list's.
            deadline = time.monotonic() + 60  # a slow machine is slow, not stuck
            while sum(e.is_set() for e in started) < 4:
                assert time.monotonic() < deadline, "four streams never started"
                await asyncio.sleep(0.05)
            signal_at = time.monotonic()
            os.kill(victim, signal.SIGTERM)
            while alive(victim) and time.monotonic() - signal_at < 30:
                await asyncio.sleep(0.05)
            exited_after.append(time.monotonic() - signal_at)
            return await asyncio.gather(*streams)

    texts = asyncio.run(main())
    assert texts == reference
    assert exited_after[0] <= DRAIN_S + 1.0  # drain, then the engine and server stop
    assert len(cluster.members(nameservice_pb2.ROLE_DECODE)) == 1
    assert_clean(cluster)


def test_stopping_the_launcher_under_load_is_prompt_and_complete(cluster):
    """Last: stops the cluster. SIGTERM to the launcher while streams run: it exits within
    the drain timeout + 2 s and no process it started is left."""
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=cluster.url, timeout=30) as http:
            while not stop.is_set():
                try:
                    with http.stream("POST", "/v1/completions", json=body(PROMPTS[1], 1900)) as r:
                        for _ in r.iter_lines():
                            pass
                except httpx.HTTPError:
                    pass  # the cluster is going away

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while sum(s.num_running for s in cluster.worker_stats().values()) == 0:  # not loaded yet
        assert time.monotonic() < deadline, "the load never reached the workers"
        time.sleep(0.05)
    signal_at = time.monotonic()
    cluster.proc.send_signal(signal.SIGTERM)
    cluster.proc.wait(30)
    took = time.monotonic() - signal_at
    stop.set()
    assert cluster.proc.returncode == 0
    assert took <= DRAIN_S + 2.0
    assert [p for p in cluster.pids() if alive(p)] == []
