"""Two tenants' keys on a launched PD cluster (`rtp-serve up --api-key-file ...`): one tenant
over its requests-a-minute limit gets 429 with Retry-After while the other is served, the
per-tenant metrics move, and no key asks for a priority above its tenant's line."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import launch

NOISY, QUIET = "sk-noisy-tenant", "sk-quiet-tenant"
KEY_FILE = f"""# two tenants
{NOISY} tenant=noisy rpm=1
{QUIET} tenant=quiet weight=2 concurrency=8 priority=-3
"""


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys = tmp / "keys.txt"
    keys.write_text(KEY_FILE)
    with launch(str(model_dir("tiny-llama")), tmp, "--api-key-file", str(keys)) as c:
        yield c
    assert c.left_running == []


def _post(http: httpx.Client, key: str, **extra) -> httpx.Response:
    body = {"model": "tiny-llama", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, **extra}
    body["ignore_eos"] = True  # 4 output tokens each, whatever the model samples
    return http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60) as client:
        auth = {"Authorization": f"Bearer {QUIET}"}
        assert client.get("/v1/models", headers=auth).json()["data"][0]["id"] == "tiny-llama"
        yield client


def _samples(http: httpx.Client) -> dict[tuple[str, frozenset], float]:
    text = http.get("/metrics", headers={"Authorization": f"Bearer {QUIET}"}).text
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("rtp:tenant_")
    }


def _get(samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_one_tenant_is_limited_while_the_other_is_served(http):
    before = _samples(http)
    first = _post(http, NOISY)
    assert first.status_code == 200, first.text
    refused = _post(http, NOISY)  # a minute has not passed: the bucket holds no request
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert error["param"] == "requests_per_minute" and error["code"] == "rate_limit_exceeded"
    assert "'noisy'" in error["message"] and error["type"] == "rate_limit_error"
    for _ in range(3):  # the other tenant is not held back
        reply = _post(http, QUIET)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    after = _samples(http)

    def moved(name: str, **labels: str) -> float:
        return _get(after, name, **labels) - _get(before, name, **labels)

    assert moved("rtp:tenant_requests_total", tenant="noisy") == 1
    assert moved("rtp:tenant_requests_total", tenant="quiet") == 3
    limit = {"tenant": "noisy", "limit": "requests_per_minute"}
    assert moved("rtp:tenant_rejections_total", **limit) == 1
    assert moved("rtp:tenant_tokens_total", tenant="quiet", kind="prompt") == 15
    assert moved("rtp:tenant_tokens_total", tenant="quiet", kind="output") == 12
    assert moved("rtp:tenant_time_to_first_token_seconds_count", tenant="quiet") == 3
    assert moved("rtp:tenant_inter_token_latency_seconds_count", tenant="quiet") == 9


def test_a_key_cannot_raise_its_priority_above_its_line(http):
    assert _post(http, QUIET, priority=-3).status_code == 200
    for key, priority in ((QUIET, -4), (NOISY, -1)):
        reply = _post(http, key, priority=priority)
        assert reply.status_code == 403, reply.text
        assert reply.json()["error"]["param"] == "priority"
