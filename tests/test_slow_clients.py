"""Slow-loris clients are cut off: headers or a body dribbled a byte at a time lose their
connection within --header-timeout / --body-timeout, while a normal client beside them is
served as usual."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from rtp_serve.core.tokenizer import Tokenizer
from rtp_serve.services.frontend.auth import ApiKeys
from rtp_serve.services.frontend.http_api import LINGER_S
from rtp_serve.services.frontend.limits import Limits
from tests.frontend_fakes import FakeWorker
from tests.fuzz_harness import served_frontend

LIMIT_S = 1.0
ADMIN = "admin-key"
SLACK_S = 1.5  # the loop's timers, a loaded machine


@pytest.fixture(scope="module")
def served(model_dir):
    tiny = model_dir("tiny-llama")
    limits = Limits(header_timeout_s=LIMIT_S, body_timeout_s=LIMIT_S)
    keys = ApiKeys.of([], admin_key=ADMIN)  # the API open; the LoRA endpoints past auth
    worker = FakeWorker(Tokenizer(tiny).encode("slow"), eos=0)
    with served_frontend(tiny, worker, limits, keys) as s:
        yield s


def dribble(url: str, head: bytes, body: bytes, gap_s: float = 0.1) -> tuple[float, bytes]:
    """Send `head` at once, then `body` a byte every `gap_s`, until the server closes the
    connection: (seconds from the first dribbled byte to the close, what it answered)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(head)
        start = time.monotonic()
        answer = b""
        sock.settimeout(gap_s)
        for byte in body:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break  # closed
            answer += chunk
        else:
            raise AssertionError("the server kept a slow client for the whole body")
        return time.monotonic() - start, answer


def normal_requests(url: str, stop: threading.Event, results: list[int]) -> None:
    with httpx.Client(base_url=url, timeout=10) as c:
        while not stop.is_set():
            body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
            results.append(c.post("/v1/completions", json=body).status_code)
            time.sleep(0.05)


def with_normal_client(url: str, fn):
    stop, results = threading.Event(), []
    t = threading.Thread(target=normal_requests, args=(url, stop, results))
    t.start()
    try:
        return fn(), results
    finally:
        stop.set()
        t.join()


def test_headers_sent_too_slowly_lose_the_connection(served) -> None:
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    (took, answer), normal = with_normal_client(
        served.url, lambda: dribble(served.url, b"", request)
    )
    assert took < LIMIT_S + SLACK_S, took
    assert answer == b""  # no request was ever complete: nothing to answer
    assert normal and set(normal) == {200}, normal


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/load_lora_adapter"])
def test_a_body_sent_too_slowly_is_408_and_closed(served, path) -> None:
    """Every route that reads a body reads it under --body-timeout (the LoRA admin ones
    once read theirs without one)."""
    body = b'{"model": "tiny-llama", "prompt": "' + b"b" * 200 + b'"}'
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {ADMIN}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    (took, answer), normal = with_normal_client(served.url, lambda: dribble(served.url, head, body))
    assert took < LIMIT_S + LINGER_S + SLACK_S, took  # answered at LIMIT_S, closed LINGER_S on
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code": "request_timeout"' in answer
    assert normal and set(normal) == {200}, normal


def test_a_kept_alive_connection_is_closed_when_idle_past_the_limit(served) -> None:
    """The same timer: after an answer, the next request's headers must come in time."""
    with httpx.Client(base_url=served.url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        time.sleep(LIMIT_S + SLACK_S)
        assert c.get("/health").status_code == 200  # httpx reconnects: the server closed
