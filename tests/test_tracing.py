"""Tracing, logs and health across a launched cluster.

One PD cluster (1 prefill, 1 decode) exports spans to a real OTLP/gRPC receiver run here;
one chat completion with an incoming `traceparent` must come back as one trace whose spans
come from every process on the request path, each parent link resolving inside the trace.
The same cluster answers the standard gRPC health check on every member. Smaller checks:
tracing off installs nothing, trace context crosses NATS, log lines carry trace ids, and a
stopping service reports NOT_SERVING to health watchers.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import secrets
import subprocess
import sys
import textwrap

import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from rtp_serve.services.common import grpc_util, subjects, tracing
from rtp_serve.services.common.bus import Bus
from rtp_serve.services.common.lifecycle import JsonFormatter
from rtp_serve.services.common.pb import events_pb2
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from tests import procs
from tests.cluster import launch
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

log = logging.getLogger(__name__)

SPAN_WAIT_S = 20.0
# (service.name, span name, kind) every traced PD request produces. A fresh prompt's lookup
# asks the cache nothing (no Cache/Get): its route says the remote tier holds none of it.
EXPECTED = {
    ("frontend", "llm_request", "server"),
    ("frontend", "tokenize", "internal"),
    ("frontend", "rtp.v1.Master/Route", "client"),
    ("master", "rtp.v1.Master/Route", "server"),
    ("frontend", "rtp.v1.Master/Release", "client"),  # the request id's lease, at the end
    ("master", "rtp.v1.Master/Release", "server"),
    ("frontend", "rtp.v1.Worker/Generate", "client"),
    ("decode", "rtp.v1.Worker/Generate", "server"),
    ("decode", "rtp.v1.Worker/Prefill", "client"),
    ("prefill", "rtp.v1.Worker/Prefill", "server"),
    ("prefill", "prefill", "internal"),
    ("prefill", "rtp.v1.Cache/Put", "client"),
    ("cache", "rtp.v1.Cache/Put", "server"),
    ("decode", "kv_transfer", "internal"),
    ("decode", "decode", "internal"),
}
HEALTH_SERVICE = {
    ns_pb2.ROLE_MASTER: "rtp.v1.Master",
    ns_pb2.ROLE_CACHE: "rtp.v1.Cache",
    ns_pb2.ROLE_PREFILL: "rtp.v1.Worker",
    ns_pb2.ROLE_DECODE: "rtp.v1.Worker",
    ns_pb2.ROLE_FUSED: "rtp.v1.Worker",
    ns_pb2.ROLE_FRONTEND: "rtp.v1.Frontend",
}
PROMPT = (
    "Write a Python function that returns the first n Fibonacci numbers as a list, "
    "then explain how the key-value cache reuses full blocks of the prompt."
)


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory, receiver):
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    with pytest.MonkeyPatch.context() as mp:  # the launcher passes its environment on
        for key, value in otel.items():
            mp.setenv(key, value)
        # Every computed block is written back, so that one request's trace has its Put.
        mp.setenv("RTP_REMOTE_WRITE", "computed")
        model = str(model_dir("tiny-llama"))
        with launch(
            model, tmp_path_factory.mktemp("traced"), "--prefill", "1", "--decode", "1"
        ) as c:
            yield c
    assert c.left_running == [], "stopping the launcher left processes running"


def _check_links(spans: list[ReceivedSpan], remote_parent: str) -> None:
    by_id = {s.span_id: s for s in spans}
    for s in spans:
        if s.name == "llm_request":
            assert s.parent_span_id == remote_parent, "the root must continue the caller's trace"
            continue
        assert s.parent_span_id in by_id, f"{s.name} [{s.service}]: parent not in the trace"
        if s.kind == "server":  # a server span's parent is the caller's client span
            parent = by_id[s.parent_span_id]
            assert (parent.kind, parent.name) == ("client", s.name), (s, parent)
            assert parent.service != s.service


def test_one_request_is_one_trace(cluster, receiver):
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    model = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    reply = httpx.post(
        cluster.url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 8,
            "temperature": 0,
        },
        headers={"traceparent": f"00-{trace_id}-{caller_span}-01"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()

    def complete(spans: list[ReceivedSpan]) -> bool:
        return {(s.service, s.name, s.kind) for s in spans if s.trace_id == trace_id} >= EXPECTED

    arrived = receiver.wait_for(complete, SPAN_WAIT_S)
    tree = receiver.tree(trace_id)
    log.info("span tree of one chat completion:\n%s", tree)  # pytest -o log_cli=true shows it
    got = {(s.service, s.name, s.kind) for s in receiver.spans(trace_id)}
    assert arrived, f"missing spans: {sorted(EXPECTED - got)}\n{tree}"

    spans = receiver.spans()
    assert {s.trace_id for s in spans} == {trace_id}, "every span belongs to the one request"
    assert {"frontend", "master", "prefill", "decode", "cache"} <= {s.service for s in spans}
    assert not [s for s in spans if s.name == "rtp.v1.Cache/Get"]
    _check_links(spans, caller_span)

    (root,) = [s for s in spans if s.name == "llm_request"]
    usage = body["usage"]
    assert root.attributes[tracing.REQUEST_ID] == body["id"]
    assert root.attributes[tracing.REQUEST_MODEL] == model
    assert root.attributes[tracing.TENANT] == "default"  # no API keys: the default tenant
    assert root.attributes[tracing.PROMPT_TOKENS] == usage["prompt_tokens"]
    assert root.attributes[tracing.COMPLETION_TOKENS] == usage["completion_tokens"]
    assert root.attributes[tracing.CACHED_TOKENS] == usage["prompt_tokens_details"]["cached_tokens"]
    assert root.attributes[tracing.FINISH_REASONS] == [body["choices"][0]["finish_reason"]]
    assert 0 < root.attributes[tracing.TIME_TO_FIRST_TOKEN] <= root.duration_ms / 1e3
    # From the route to the first token, and the prefill worker's split of it (no worker
    # had a fitted model for the master to predict with yet: 0s).
    routed = root.attributes[tracing.ROUTED_TTFT]
    assert 0 < routed <= root.attributes[tracing.TIME_TO_FIRST_TOKEN]
    queued, computing = (
        root.attributes[tracing.WORKER_QUEUE],
        root.attributes[tracing.WORKER_PREFILL],
    )
    assert queued >= 0 and computing > 0 and queued + computing < routed
    assert root.attributes[tracing.PREDICTED_TTFT] == 0.0
    (route,) = [s for s in spans if (s.service, s.name) == ("master", "rtp.v1.Master/Route")]
    assert route.attributes["rtp.route.policy"] and route.attributes["rtp.route.decode"]
    (prefill,) = [s for s in spans if s.name == "prefill"]
    computed = prefill.attributes["rtp.prefill.tokens_computed"]
    assert computed == usage["prompt_tokens"] - prefill.attributes["rtp.prefill.tokens_cached"]
    (kv,) = [s for s in spans if s.name == "kv_transfer"]
    assert kv.attributes["rtp.kv.blocks_received"] > 0 and kv.attributes["rtp.kv.bytes_received"]
    (decode,) = [s for s in spans if s.name == "decode"]
    assert decode.attributes["rtp.decode.tokens_generated"] == usage["completion_tokens"]


def test_every_member_reports_serving(cluster):
    assert httpx.get(cluster.url + "/health", timeout=5).json() == {"status": "ok"}
    assert httpx.get(cluster.url + "/ready", timeout=5).status_code == 200
    members = cluster.members()
    assert {m.role for m in members} >= set(HEALTH_SERVICE) - {ns_pb2.ROLE_FUSED}
    targets = [(cluster.nameservice, "rtp.v1.NameService")]
    targets += [(m.address, HEALTH_SERVICE[m.role]) for m in members]

    async def check() -> dict[tuple[str, str], int]:
        out = {}
        for address, service in targets:
            async with grpc_util.channel(address) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                for name in ("", service):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                    out[(address, name)] = reply.status
        return out

    statuses = asyncio.run(check())
    assert set(statuses.values()) == {health_pb2.HealthCheckResponse.SERVING}, statuses


@pytest.mark.parametrize("service", ["nameservice", "master", "cache"])
def test_stopping_service_reports_not_serving(service):
    async def watch(address: str, proc: subprocess.Popen) -> list[int]:
        seen: list[int] = []
        async with grpc_util.channel(address) as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            async for reply in call:
                seen.append(reply.status)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    proc.terminate()  # SIGTERM: the service shuts down gracefully
                elif reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
        return seen

    with procs.grpc_service(service) as (address, proc):
        seen = asyncio.run(asyncio.wait_for(watch(address, proc), 15))
    assert seen[0] == health_pb2.HealthCheckResponse.SERVING
    assert seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING


def test_tracing_off_installs_nothing():
    script = textwrap.dedent(
        """
        import sys
        from opentelemetry import trace
        from rtp_serve.services.common import grpc_util, tracing
        assert not tracing.setup_tracing("master", "m-1")
        assert not tracing.enabled()
        assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
        assert "opentelemetry.sdk" not in sys.modules, "the SDK is not even imported"
        assert tracing.client_interceptors("127.0.0.1:1") == []
        assert tracing.server_interceptors() == []
        with tracing.tracer.start_as_current_span("x") as span:
            assert not span.is_recording()
            assert tracing.inject_headers(None) is None
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)


def test_tracing_on_sets_the_resource():
    script = textwrap.dedent(
        """
        from opentelemetry import trace
        from rtp_serve.services.common import tracing
        assert tracing.setup_tracing("decode", "host-42")
        attrs = trace.get_tracer_provider().resource.attributes
        assert attrs["service.name"] == "decode", attrs
        assert attrs["service.instance.id"] == "host-42", attrs
        assert len(tracing.client_interceptors("127.0.0.1:1")) == 4
        assert len(tracing.server_interceptors()) == 1
        tracing.shutdown_tracing(timeout_s=2)
        assert not tracing.enabled()
        """
    )
    # Nothing listens there: setup must not need the collector.
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)


def test_trace_context_crosses_nats(nats_server):
    tracer = TracerProvider().get_tracer("test")  # a local SDK: the global stays unset

    async def main() -> tuple[dict[str, str], str | None, str]:
        sub, pub = await Bus.connect(nats_server, "sub"), await Bus.connect(nats_server, "pub")
        subject = subjects.load_report(f"w{secrets.token_hex(4)}", namespace="tracetest")
        got: asyncio.Queue[tuple[dict[str, str], str | None]] = asyncio.Queue()

        async def handler(msg: events_pb2.LoadReport, headers: dict[str, str]) -> None:
            await got.put((headers, tracing.current_trace_id()))

        await sub.subscribe(subject, events_pb2.LoadReport, handler)
        with tracer.start_as_current_span("publisher"):
            sent_trace = tracing.current_trace_id()
            await pub.publish(subject, events_pb2.LoadReport(worker_id="w"))
        headers, seen_trace = await asyncio.wait_for(got.get(), 5)
        await sub.close()
        await pub.close()
        assert sent_trace is not None
        return headers, seen_trace, sent_trace

    headers, seen_trace, sent_trace = asyncio.run(main())
    assert headers["traceparent"].split("-")[1] == sent_trace
    assert seen_trace == sent_trace


def test_log_lines_carry_trace_and_request_ids():
    tracer = TracerProvider().get_tracer("test")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(tracing.TraceContextFilter())
    logger = logging.getLogger("test_tracing.logs")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("outside any request")
        with tracer.start_as_current_span("request") as span:
            logger.warning("about request r-1", extra={"request_id": "r-1"})
        expected = format(span.get_span_context().trace_id, "032x")
    finally:
        logger.removeHandler(handler)
    outside, inside = [json.loads(line) for line in out.getvalue().splitlines()]
    assert "trace_id" not in outside and "request_id" not in outside
    assert inside["trace_id"] == expected and inside["request_id"] == "r-1"
