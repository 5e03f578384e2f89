"""Property-based fuzzing of the gRPC ingress (`Frontend.Generate`) over scripted workers:
random and invalid fields, garbage bytes as the message. No INTERNAL or UNKNOWN status,
and a normal request is served afterwards. (A real worker's `Worker.Generate`: in
test_fuzz_cluster.py.)"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings

from rtp_serve.core.tokenizer import Tokenizer
from rtp_serve.services.common.pb import common_pb2, frontend_pb2, frontend_pb2_grpc
from tests.frontend_fakes import FakeWorker
from tests.fuzz_grpc import GARBAGE, call_stream, check_status, frontend_requests
from tests.fuzz_harness import served_frontend

GENERATE = "/rtp.v1.Frontend/Generate"
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


@pytest.fixture(scope="module")
def tiny(model_dir):
    return model_dir("tiny-llama")


@pytest.fixture(scope="module")
def script(tiny) -> list[int]:
    return Tokenizer(tiny).encode("Hello, gRPC fuzz.")


@pytest.fixture(scope="module")
def channel(tiny, script):
    with (
        served_frontend(tiny, FakeWorker(script, eos=0)) as served,
        grpc.insecure_channel(served.grpc_address) as ch,
    ):
        yield ch


def test_no_request_is_a_server_error(channel, tiny, script) -> None:
    stub = frontend_pb2_grpc.FrontendStub(channel)

    @FUZZ
    @given(request=frontend_requests())
    def fuzz(request: frontend_pb2.FrontendGenerateRequest) -> None:
        try:
            for _ in stub.Generate(request, timeout=60):
                pass
        except grpc.RpcError as exc:
            check_status(request, exc)

    fuzz()
    assert_serves(stub, tiny, script)


def test_garbage_bytes_are_invalid_argument(channel, tiny, script) -> None:
    @FUZZ
    @given(payload=GARBAGE)
    def fuzz(payload: bytes) -> None:
        check_status(payload, call_stream(channel, GENERATE, payload))

    fuzz()
    exc = call_stream(channel, GENERATE, b"\xff\xff\xff")
    assert exc is not None and exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
    assert_serves(frontend_pb2_grpc.FrontendStub(channel), tiny, script)


NON_FINITE = [
    ("temperature", float("inf"), "temperature"),
    ("temperature", float("nan"), "temperature"),
    ("top_p", float("-inf"), "top_p"),
    ("presence_penalty", float("nan"), "presence_penalty"),
    ("repetition_penalty", float("inf"), "repetition_penalty"),
    ("logit_bias", float("inf"), "logit_bias[7]"),
]


@pytest.mark.parametrize(("field", "value", "named"), NON_FINITE)
def test_non_finite_sampling_floats_are_invalid_argument(channel, field, value, named) -> None:
    """Proto floats carry inf and NaN (JSON cannot): refused at the ingress, naming the
    field, before any worker sees them."""
    params = common_pb2.SamplingParams(max_tokens=4)
    if field == "logit_bias":
        params.logit_bias[7] = value
    else:
        setattr(params, field, value)
    request = frontend_pb2.FrontendGenerateRequest(text="hi", params=params)
    exc = call_stream(channel, GENERATE, request.SerializeToString())
    assert exc is not None and exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
    assert named in exc.details() and "finite" in exc.details(), exc.details()


def assert_serves(stub, tiny, script) -> None:
    request = frontend_pb2.FrontendGenerateRequest(
        text="hi", params=common_pb2.SamplingParams(max_tokens=4)
    )
    out = list(stub.Generate(request, timeout=30))
    assert "".join(m.text for m in out) == Tokenizer(tiny).decode(script[:4])
    assert out[-1].finished
