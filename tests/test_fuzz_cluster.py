"""The fuzzers against a launched cluster (one fused worker, real engine): a few dozen
hostile HTTP requests, `Frontend.Generate` calls and `Worker.Generate` calls straight to
the worker, then: every process still runs, a normal request gets the offline engine's
greedy text, and no worker holds a block. (The fast, broad runs are over scripted workers:
test_fuzz_http.py, test_fuzz_grpc.py.)"""

from __future__ import annotations

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from rtp_serve.engine import LLM, SamplingParams
from rtp_serve.services.common.pb import frontend_pb2_grpc, worker_pb2_grpc
from rtp_serve.services.common.pb import nameservice_pb2 as ns_pb2
from tests.cluster import launch
from tests.fuzz_grpc import GARBAGE, call_stream, check_status, frontend_requests, worker_requests
from tests.fuzz_http import check_answer, http_cases, send
from tests.openapi_strategies import OpenAPI

FEW = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
# The frontend's limits, from the environment its flags default from: outputs stay short
# (a fuzzed request may ask for the whole context, n times), so the run stays short.
FRONTEND_ENV = {"RTP_MAX_TOKENS_LIMIT": "16", "RTP_MAX_N": "2"}


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return str(model_dir("tiny-llama"))


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        for key, value in FRONTEND_ENV.items():
            env.setenv(key, value)
        with launch(model, tmp_path_factory.mktemp("fuzz"), "--fused", "1") as c:
            yield c
    assert c.left_running == [], "stopping the launcher left processes running"


def test_hostile_input_against_a_launched_cluster(cluster, model) -> None:
    (frontend,) = cluster.members(ns_pb2.ROLE_FRONTEND)
    (worker,) = cluster.workers()
    pids = cluster.pids
    with httpx.Client(base_url=cluster.url, timeout=120) as http:
        api = OpenAPI(http.get("/openapi.json").json())
        served = http.get("/v1/models").json()["data"][0]["id"]

        @FEW
        @given(case=http_cases(api, served))
        def fuzz_http(case) -> None:
            check_answer(case, send(http, case))

        fuzz_http()

    with grpc.insecure_channel(frontend.address) as ch:
        stub = frontend_pb2_grpc.FrontendStub(ch)

        @FEW
        @given(request=frontend_requests())
        def fuzz_frontend(request) -> None:
            try:
                for _ in stub.Generate(request, timeout=120):
                    pass
            except grpc.RpcError as exc:
                check_status(request, exc)

        fuzz_frontend()
        check_status(b"\xff", call_stream(ch, "/rtp.v1.Frontend/Generate", b"\xff"))

    with grpc.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)

        @FEW
        @given(request=worker_requests(), garbage=GARBAGE)
        def fuzz_worker(request, garbage) -> None:
            try:
                for _ in stub.Generate(request, timeout=120):
                    pass
            except grpc.RpcError as exc:
                check_status(request, exc)
            check_status(garbage, call_stream(ch, "/rtp.v1.Worker/Generate", garbage))

        fuzz_worker()

    # Nothing crashed or restarted, the cluster still serves exactly, and nothing leaked.
    assert cluster.proc.poll() is None and cluster.pids == pids
    prompt = "def fibonacci(n):\n    "
    expected = LLM(model, num_kv_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0)
    )[0]
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        body = {"model": served, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["choices"][0]["text"] == expected.text
    for worker_id, s in cluster.wait_idle().items():
        assert s.held_blocks == 0 and s.num_running == 0 and s.integrity_ok, (worker_id, s)
