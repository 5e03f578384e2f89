"""Conditional disaggregation end to end: a PD cluster where the master keeps short prompts
on the decode worker (--max-local-prefill-tokens) and sends long ones to the prefill worker.
Both kinds give the in-process engine's greedy text; the master's route metric and the
prefill worker's metrics say which way each went."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from rtp_serve.engine import LLM, SamplingParams
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from tests.cluster import launch

THRESHOLD = 48


def _samples(address: str, name: str) -> list:
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def _local_routes(cluster) -> float:
    (master,) = cluster.members(ns_pb2.ROLE_MASTER)
    samples = _samples(master.metrics_address, "rtp:route_decisions_total")
    return sum(s.value for s in samples if s.labels.get("reason") == "local_prefill")


def _blocks_sent(cluster) -> float:
    """KV blocks the prefill worker has sent to decode workers."""
    (prefill,) = cluster.members(ns_pb2.ROLE_PREFILL)
    return sum(s.value for s in _samples(prefill.metrics_address, "rtp:kv_transfer_blocks_total"))


def test_short_prompts_stay_on_the_decode_worker(model_dir, tmp_path, corpus_ids):
    model = str(model_dir("tiny-llama"))
    short, long = corpus_ids[:20], corpus_ids[20:120]  # 20 < THRESHOLD <= 100 tokens
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    ref = [o.text for o in LLM(model, num_kv_blocks=64).generate([short, long], greedy)]
    flags = ("--prefill", "1", "--decode", "1", "--max-local-prefill-tokens", str(THRESHOLD))
    with launch(model, tmp_path, *flags) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=60)
        model_id = client.models.list().data[0].id

        def complete(prompt: list[int]) -> str:
            out = client.completions.create(
                model=model_id, prompt=prompt, max_tokens=12, temperature=0
            )
            return out.choices[0].text

        before = (_local_routes(c), _blocks_sent(c))
        text_short = complete(short)
        after_short = (_local_routes(c), _blocks_sent(c))
        text_long = complete(long)
        after_long = (_local_routes(c), _blocks_sent(c))
    assert (text_short, text_long) == tuple(ref)
    assert after_short == (before[0] + 1, before[1])  # routed local, no KV moved
    assert after_long[0] == after_short[0] and after_long[1] > after_short[1]  # PD
    assert c.left_running == []
