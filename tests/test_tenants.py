"""Tenants at the frontend: the key file's line format, the tenant table and its metrics
labels, and per-tenant admission (token buckets, concurrency) on a scripted clock."""

import pytest
from prometheus_client import REGISTRY

from rtp_serve.core.tenant import TenantShare
from rtp_serve.services.common.pb import worker_pb2
from rtp_serve.services.frontend import auth, metrics
from rtp_serve.services.frontend.auth import ApiKeys
from rtp_serve.services.frontend.errors import ErrorKind, FrontendError
from rtp_serve.services.frontend.tenant_limits import TenantLimiter
from rtp_serve.services.frontend.tenants import OTHER, KeyLine, TenantSpec, TenantTable

MODEL = "tenants-test-model"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(lines: list[str], replicas: int = 1, labels: int = 16) -> tuple[TenantLimiter, Clock]:
    table = TenantTable.of([auth.parse_key(line) for line in lines], labels)
    clock = Clock()
    return TenantLimiter(table, metrics.frontend(MODEL).tenant, replicas, clock), clock


def refusal(lim: TenantLimiter, tenant: str, prompt: int) -> FrontendError:
    with pytest.raises(FrontendError) as err:
        lim.admit(lim.table.get(tenant), prompt)
    assert err.value.kind == ErrorKind.OVERLOADED and err.value.kind.http_status == 429
    return err.value


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model_name": MODEL, **labels}) or 0.0


def test_key_lines_name_a_tenant_its_weight_and_limits():
    line = auth.parse_key("sk-1 tenant=acme weight=2.5 tpm=600 rpm=60 concurrency=4 priority=-1")
    assert line == KeyLine(
        "sk-1",
        -1,
        "acme",
        (
            ("weight", 2.5),
            ("tokens_per_minute", 600),
            ("requests_per_minute", 60),
            ("concurrency", 4),
        ),
    )
    assert auth.parse_key("sk-2") == KeyLine("sk-2")  # the default tenant, as before tenants
    for bad in (
        "k tenant=",
        "k tenant=a/b",
        f"k tenant={OTHER}",
        "k weight=0",
        "k weight=nan",
        "k tpm=-5",
        "k rpm=1.5",
        "k concurrency=x",
        "k limit=3",
    ):
        with pytest.raises(ValueError) as err:
            auth.parse_key(bad)
        assert "k " not in str(err.value)  # the entry is not echoed (it may hold a key)


def test_a_tenants_keys_share_it_and_must_agree():
    keys = ApiKeys.of(
        [auth.parse_key(x) for x in ("a1 tenant=acme weight=2 rpm=5", "a2 tenant=acme", "b")]
    )
    acme = TenantSpec("acme", 2.0, requests_per_minute=5)
    assert keys.tenant("Bearer a1") == keys.tenant("Bearer a2") == acme
    assert keys.tenant("Bearer b") == keys.tenant(None) == TenantSpec()
    assert keys.tenant("Bearer a1").share == TenantShare("acme", 2.0)
    assert ApiKeys.of([]).tenant(None) == TenantSpec()  # no keys: the default tenant
    with pytest.raises(ValueError, match="'acme'.*weight"):
        TenantTable.of(
            [auth.parse_key("a1 tenant=acme weight=2"), auth.parse_key("a2 tenant=acme weight=3")]
        )


def test_metrics_labels_are_the_top_tenants_and_other():
    lines = [f"k{i} tenant=t{i} weight={1 + i % 3}" for i in range(10)]
    table = TenantTable.of([auth.parse_key(x) for x in lines], num_labels=4)
    named = {n for n, label in table.labels.items() if label != OTHER}
    # weight 3 first (t2, t5, t8), then weight 2 in file order (t1); the default has weight 1
    assert named == {"t2", "t5", "t8", "t1"}
    assert table.label("t0") == table.label("default") == table.label("unknown") == OTHER


def test_requests_per_minute_refuses_with_retry_after_and_refills():
    lim, clock = limiter(["a tenant=a rpm=2", "b tenant=b"])
    before = sample("rtp:tenant_rejections_total", tenant="a", limit="requests_per_minute")
    for _ in range(2):
        lim.admit(lim.table.get("a"), 10).close()
    exc = refusal(lim, "a", 10)
    assert exc.param == "requests_per_minute" and "requests_per_minute" in exc.message
    assert exc.retry_after == 30  # one request refills in 60 s / 2
    assert sample("rtp:tenant_rejections_total", tenant="a", limit="requests_per_minute") == (
        before + 1
    )
    lim.admit(lim.table.get("b"), 10).close()  # the other tenant is not limited
    clock.now += 29
    refusal(lim, "a", 10)
    clock.now += 1
    lim.admit(lim.table.get("a"), 10).close()


def test_tokens_per_minute_count_the_prompt_then_the_output():
    lim, clock = limiter(["a tenant=a tpm=120"])
    a = lim.table.get("a")
    with lim.admit(a, 100) as lease:  # 20 left
        lease.output(50)  # streamed output overdraws: -30
    exc = refusal(lim, "a", 10)  # needs 40 more, at 2 a second
    assert exc.param == "tokens_per_minute" and exc.retry_after == 20
    clock.now += 20
    lim.admit(a, 10).close()
    # A prompt larger than a minute's worth waits for a full bucket, then goes.
    clock.now += 60
    lim.admit(a, 500).close()
    assert refusal(lim, "a", 1).retry_after > 60


def test_a_refusal_takes_nothing():
    lim, clock = limiter(["a tenant=a tpm=100 rpm=10"])
    a = lim.table.get("a")
    lim.admit(a, 100).close()  # the tokens are spent; 9 requests are left
    clock.now += 3  # 5 tokens back
    refusal(lim, "a", 50)  # over tokens: the request bucket is not charged
    state = lim._states["a"]
    assert state.requests.level == pytest.approx(9 + 3 * 10 / 60)
    assert state.tokens.level == pytest.approx(5) and state.in_flight == 0
    clock.now += 60
    lim.admit(a, 100).close()


def test_concurrency_counts_requests_in_flight():
    lim, _ = limiter(["a tenant=a concurrency=2"])
    a = lim.table.get("a")
    first, second = lim.admit(a, 1), lim.admit(a, 1)
    exc = refusal(lim, "a", 1)
    assert exc.param == "concurrency" and exc.retry_after == 1
    first.close()
    first.close()  # closing twice releases once
    assert lim.in_flight("a") == 1
    lim.admit(a, 1).close()
    second.close()
    assert lim.in_flight("a") == 0


def test_replicas_each_enforce_their_share():
    lim, _ = limiter(["a tenant=a rpm=6 concurrency=3 tpm=600"], replicas=3)
    state = lim._state(lim.table.get("a"))
    assert (state.requests.capacity, state.concurrency, state.tokens.capacity) == (2, 1, 200)
    lim.admit(lim.table.get("a"), 1)
    exc = refusal(lim, "a", 1)
    assert "1/3" in exc.message
    with pytest.raises(ValueError):
        limiter([], replicas=0)


def test_admission_moves_the_tenants_counters():
    lim, _ = limiter(["a tenant=a"])
    requests = sample("rtp:tenant_requests_total", tenant="a")
    prompt = sample("rtp:tenant_tokens_total", tenant="a", kind="prompt")
    output = sample("rtp:tenant_tokens_total", tenant="a", kind="output")
    with lim.admit(lim.table.get("a"), 7) as lease:
        lease.output(3)
    assert sample("rtp:tenant_requests_total", tenant="a") == requests + 1
    assert sample("rtp:tenant_tokens_total", tenant="a", kind="prompt") == prompt + 7
    assert sample("rtp:tenant_tokens_total", tenant="a", kind="output") == output + 3


def test_the_frontend_sends_the_tenant_and_refuses_past_its_limit(model_dir):
    """Through both ingresses over a fake worker: the key's tenant and weight reach the
    worker's GenerateRequest; past the tenant's limit, HTTP 429 with Retry-After and gRPC
    RESOURCE_EXHAUSTED with a retry-after trailer, while another tenant is served."""
    import grpc
    import httpx

    from rtp_serve.core.tokenizer import Tokenizer
    from rtp_serve.services.common.pb import common_pb2, frontend_pb2, frontend_pb2_grpc
    from tests.frontend_fakes import FakeWorker
    from tests.fuzz_harness import served_frontend

    tiny = model_dir("tiny-llama")
    worker = FakeWorker(Tokenizer(tiny).encode("one two three four"), eos=0)
    lines = ["sk-a tenant=acme weight=3 rpm=1", "sk-b tenant=beta"]
    keys = ApiKeys.of([auth.parse_key(line) for line in lines])
    body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 2}
    with served_frontend(tiny, worker, keys=keys) as served:
        with httpx.Client(base_url=served.url, timeout=30) as c:

            def post(key: str) -> httpx.Response:
                return c.post("/v1/completions", json=body, headers={"Authorization": key})

            assert post("Bearer sk-a").status_code == 200
            assert worker.requests[-1].tenant == worker_pb2.Tenant(name="acme", weight=3.0)
            refused = post("Bearer sk-a")
            assert refused.status_code == 429 and 1 <= int(refused.headers["Retry-After"]) <= 60
            assert refused.json()["error"]["param"] == "requests_per_minute"
            assert post("Bearer sk-b").status_code == 200
            assert worker.requests[-1].tenant == worker_pb2.Tenant(name="beta", weight=1.0)
        request = frontend_pb2.FrontendGenerateRequest(
            text="hi", params=common_pb2.SamplingParams(max_tokens=2)
        )
        with grpc.insecure_channel(served.grpc_address) as ch:
            stub = frontend_pb2_grpc.FrontendStub(ch)
            with pytest.raises(grpc.RpcError) as exc:
                list(
                    stub.Generate(request, metadata=[("authorization", "Bearer sk-a")], timeout=30)
                )
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "requests_per_minute" in exc.value.details()
            trailers = dict(exc.value.trailing_metadata())
            assert 1 <= int(trailers["retry-after"]) <= 60
            assert list(stub.Generate(request, metadata=[("authorization", "Bearer sk-b")]))
