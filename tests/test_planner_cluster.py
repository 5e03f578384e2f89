"""The planner on real clusters (tiny-llama, real processes, the official openai client).

- Drain-then-stop: the planner's own local actuator stops a decode worker under 8 greedy
  streams; every stream ends with the offline engine's text (those the drain did not finish
  resume on the other decode worker).
- Scale to zero: `rtp-serve up --planner --min-workers 0` starts with no worker; a request
  is held at the frontend while the planner starts one, and gets its answer; a second one
  sent meanwhile starts no second worker; once idle, the worker stops again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request

import openai
import pytest

from rtp_serve.engine import LLM, SamplingParams
from rtp_serve.services.common import subjects
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.pb import events_pb2, nameservice_pb2
from rtp_serve.services.planner.main import make_actuator
from tests.cluster import launch

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\nclass Config:",
    "The quick brown fox",
    "for i in range(10):\n    print(i)\n",
    "Once upon a time",
    "SELECT * FROM users WHERE",
    "The capital of France is",
    "class Stack:\n    def __init__(self):",
]
STREAM_TOKENS = 96


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return str(model_dir("tiny-llama"))


@pytest.fixture(scope="module")
def reference(model):
    llm = LLM(model, num_kv_blocks=256)
    params = SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)
    return {p: out.text for p, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True)}


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


async def _stream(client: openai.AsyncOpenAI, model: str, prompt: str) -> str:
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=STREAM_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = []
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
    return "".join(text)


def test_scaling_a_decode_worker_down_under_streams_loses_nothing(model, reference, tmp_path):
    with launch(model, tmp_path, "--prefill", "1", "--decode", "1", "--threads", "1") as c:
        args = argparse.Namespace(
            actuator="local", engine="real", nameservice=c.nameservice, nats_url=c.info["nats"],
            drain_timeout=1.0,  # short: some streams outlive it and must resume elsewhere
            worker_flags=f"--model {model} --threads 1 --kv-cache-mib 256",
        )  # fmt: skip
        actuator = make_actuator(args, observer=None)

        async def run() -> list[str]:
            await actuator.scale("decode", 1)
            (worker_id,) = [wid for _, wid, _ in actuator.running()]
            deadline = time.monotonic() + 120
            while worker_id not in {m.id for m in await asyncio.to_thread(c.workers)}:
                assert time.monotonic() < deadline, "the planner's decode worker never registered"
                await asyncio.sleep(0.1)
            # The master ranks a worker without a load report after those with one: wait
            # for two of its reports (the master, subscribed all along, has the first).
            reports: asyncio.Queue[events_pb2.LoadReport] = asyncio.Queue()
            bus = await Bus.connect(c.info["nats"], "test-planner")
            try:
                await bus.subscribe(
                    subjects.load_report(worker_id), events_pb2.LoadReport,
                    lambda msg, _: reports.put(msg),
                )  # fmt: skip
                for _ in range(2):
                    await asyncio.wait_for(reports.get(), 60)
            finally:
                await bus.close()
            client = _client(c.url)
            model_id = (await client.models.list()).data[0].id
            streams = [asyncio.create_task(_stream(client, model_id, p)) for p in PROMPTS]
            # Down as soon as it holds some of them: a stream of this model ends within a
            # second or two, so one look after all had started could find it done already.
            deadline = time.monotonic() + 120
            while True:
                stats = (await asyncio.to_thread(c.worker_stats))[worker_id]
                if stats.num_running + stats.num_waiting > 0:
                    break
                ended = all(t.done() for t in streams)
                assert not ended and time.monotonic() < deadline, (
                    "no stream ran on the worker being scaled down"
                )
                await asyncio.sleep(0.02)
            await actuator.scale("decode", 0, victims=[worker_id])
            texts = await asyncio.gather(*streams)
            # Its streams moved and ended; its deregistration may still be on the way.
            deadline = time.monotonic() + 30
            while worker_id in {m.id for m in await asyncio.to_thread(c.workers)}:
                assert time.monotonic() < deadline, f"{worker_id} still registered"
                await asyncio.sleep(0.1)
            await actuator.close()
            return texts

        texts = asyncio.run(run())
    assert texts == [reference[p] for p in PROMPTS]


def _plan(url: str) -> dict:
    with urllib.request.urlopen(url + "/plan", timeout=5) as reply:
        return json.loads(reply.read())


def test_scale_to_zero_holds_the_request_and_starts_one_worker(model, reference, tmp_path):
    flags = (
        "--planner", "--fused", "1", "--min-workers", "0", "--max-workers", "2",
        "--threads", "1", "--planner-interval-s", "0.5", "--idle-to-zero-s", "3",
        "--down-cooldown-s", "1", "--ttft-p95-ms", "60000", "--itl-p95-ms", "5000",
        "--hold-for-workers-s", "120",
    )  # fmt: skip
    with launch(model, tmp_path, *flags) as c:
        assert c.workers() == []  # up and ready at zero workers
        fused = nameservice_pb2.ROLE_FUSED

        async def run() -> list[str]:
            client = _client(c.url)
            model_id = (await client.models.list()).data[0].id
            first = asyncio.create_task(_stream(client, model_id, PROMPTS[0]))
            await asyncio.sleep(0.2)
            second = asyncio.create_task(_stream(client, model_id, PROMPTS[1]))
            return list(await asyncio.gather(first, second))

        texts = asyncio.run(run())
        assert texts == [reference[PROMPTS[0]], reference[PROMPTS[1]]]
        plan = _plan(c.info["planner"])
        started = [p for p in c.members(fused)]
        assert len(started) == 1, f"two held requests started {len(started)} workers"
        assert plan["current"]["fused"] <= 1
        # idle: the worker goes away again
        deadline = time.monotonic() + 60
        while c.members(fused):
            assert time.monotonic() < deadline, f"still {len(c.members(fused))} workers when idle"
            time.sleep(0.25)
