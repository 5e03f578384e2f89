"""The cluster in containers, on a real Docker engine, serving the real default model.

docker/build-images.sh builds the two images (from a base it makes out of a Debian mirror
where no registry is reachable); compose.yaml runs them. Through the official `openai`
client: the chat answer equals the in-process engine's greedy text; scaled to 2 prefill + 2
decode, the master lists all four and both of each take requests; a decode container
SIGKILLed (`docker kill`) under 8 greedy streams, and another stopped (`docker stop`, its
drain) under 8 more, lose none and change no text; compose.secure.yaml refuses a request
without the key; `down -v` leaves no container, network or volume of the project.

Works with `docker compose` (v2) and Debian's `docker-compose` 1.29, whichever is there (1.29
has no `up --wait`: readiness is polled on the frontend's /ready, which is what compose's
own healthcheck asks). Skips only where no Docker engine answers; .ci/run starts one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from rtp_serve.engine import LLM, SamplingParams
from rtp_serve.services.launcher.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Distinct from their first block on (no prefix in common to route by), and long enough that
# a prefill takes a while, so the master spreads them by load.
STREAM_PROMPTS = [
    f"Story {n}. " + "Once upon a time a small robot learned to count the stars above the sea, "
    "and every night it wrote the numbers in a notebook that it kept under a stone. "
    * 6
    + f"Write one sentence about the number {n}."
    for n in range(8)
]
STREAM_TOKENS = 160  # long enough that every stream still runs when a fault is chosen


def _engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


if not _engine_answers():
    pytest.skip(
        "NO DOCKER ENGINE: the container tests did not run (apt-get install -y docker.io "
        "docker-compose debootstrap, then start dockerd as root; .ci/run does)",
        allow_module_level=True,
    )


def _compose_cli() -> list[str]:
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True)
    if v2.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("NO COMPOSE: neither `docker compose` nor `docker-compose` is installed")


class Project:
    """One compose project of this repository's files, under a name of its own."""

    def __init__(self, name: str, files: list[str], directory: Path = ROOT) -> None:
        self.name = name
        self.port = free_port()
        self.cli = _compose_cli()
        self.base = [*self.cli, "--project-directory", str(directory), "-p", name]
        for f in files:
            self.base += ["-f", str(ROOT / f)]
        self.env = {
            **os.environ,
            "RTP_HTTP_PORT": str(self.port),
            # the workers share two cores with everything else: one torch thread each
            "RTP_WORKER_THREADS": "1",
        }
        self.url = f"http://127.0.0.1:{self.port}"
        self.reference: list[tuple[str, str]] | None = None  # unfaulted streams, once measured

    def __call__(self, *args: str, timeout: float = 600) -> str:
        out = subprocess.run(
            [*self.base, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert out.returncode == 0, f"compose {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    def up(self, *args: str) -> None:
        self("up", "-d", "--no-build", *args)
        self.wait_ready()

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        logs = self("logs", "--tail", "30", timeout=60)
        raise AssertionError(f"{self.name} not ready after {timeout} s:\n{logs[-8000:]}")

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service).split()

    def wait_healthy(self, service: str, timeout: float = 300) -> None:
        """Until every replica of `service` passes its healthcheck (a restarted one loads)."""
        deadline = time.monotonic() + timeout
        while True:
            states = [
                subprocess.run(
                    ["docker", "inspect", "-f", "{{.State.Health.Status}}", c],
                    capture_output=True,
                    text=True,
                ).stdout.strip()
                for c in self.containers(service)
            ]
            if states and all(s == "healthy" for s in states):
                return
            assert time.monotonic() < deadline, (service, states)
            time.sleep(2)

    def python(self, container: str, code: str) -> str:
        out = subprocess.run(
            ["docker", "exec", container, "python", "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    def down(self) -> None:
        self("down", "-v", "--remove-orphans", "--timeout", "30")

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.name}"
        return {
            kind: subprocess.run(
                ["docker", *command, "--filter", label],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            for kind, command in {
                "containers": ["ps", "-aq"],
                "networks": ["network", "ls", "-q"],
                "volumes": ["volume", "ls", "-q"],
            }.items()
        }


@pytest.fixture(scope="module")
def images() -> None:
    """Built once per run; later runs reuse every cached layer."""
    out = subprocess.run(
        ["bash", str(ROOT / "docker/build-images.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert out.returncode == 0, out.stderr[-6000:]


@pytest.fixture(scope="module")
def offline(smollm2) -> str:
    """The in-process engine's greedy answer to the question, as the frontend encodes it."""
    llm = LLM(str(smollm2), num_kv_blocks=64)
    ids = llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template(QUESTION), add_special_tokens=False
    )
    [out] = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))
    return out.text


@pytest.fixture(scope="module")
def cluster(images) -> Iterator[Project]:
    project = Project(f"rtpcompose{os.getpid()}", ["compose.yaml"])
    try:
        project.up()
        yield project
    finally:
        project.down()


def _client(project: Project) -> openai.OpenAI:
    return openai.OpenAI(base_url=project.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _streams(project: Project, started: threading.Event | None = None) -> list[tuple[str, str]]:
    """8 concurrent greedy streams' (text, finish reason); `started` is set once every stream
    has its first tokens (or has already ended)."""
    client = _client(project)
    barrier = threading.Barrier(len(STREAM_PROMPTS), action=started.set if started else None)

    def one(prompt: str) -> tuple[str, str]:
        stream = client.completions.create(
            model="smollm2-135m-v1",
            prompt=prompt,
            max_tokens=STREAM_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},  # every stream runs its whole length
        )
        parts, reason, waited = [], None, False
        for n, chunk in enumerate(stream, 1):
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
            if n == 3:
                barrier.wait(timeout=300)
                waited = True
        if not waited:
            barrier.wait(timeout=300)
        assert reason == "length", reason
        return "".join(parts), reason

    with ThreadPoolExecutor(len(STREAM_PROMPTS)) as pool:
        return list(pool.map(one, STREAM_PROMPTS))


_RUNNING = """
import asyncio
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.pb import worker_pb2, worker_pb2_grpc

async def main():
    async with grpc_util.channel('127.0.0.1:50051', None) as ch:
        stats = await worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.WorkerStatsRequest(), timeout=5)
    print(stats.num_running + stats.num_waiting)

asyncio.run(main())
"""


def _running(project: Project, container: str) -> int:
    """Requests a worker's engine holds now (its Stats, not a gauge between load reports)."""
    return int(project.python(container, _RUNNING))


_COUNTS = """
import json, urllib.request
text = urllib.request.urlopen('http://127.0.0.1:9100/metrics').read().decode()
print(json.dumps({line.rsplit(' ', 1)[0]: float(line.rsplit(' ', 1)[1])
                  for line in text.splitlines() if line and not line.startswith('#')}))
"""

_MEMBERS = """
import asyncio, json
from rtp_serve.services.common import grpc_util
from rtp_serve.services.common.pb import master_pb2, master_pb2_grpc, nameservice_pb2, nameservice_pb2_grpc

async def main():
    async with grpc_util.channel('nameservice:50051', None) as ch:
        reply = await nameservice_pb2_grpc.NameServiceStub(ch).List(nameservice_pb2.ListRequest(), timeout=5)
    async with grpc_util.channel('127.0.0.1:50051', None) as ch:
        index = await master_pb2_grpc.MasterStub(ch).Index(master_pb2.IndexRequest(), timeout=5)
    print(json.dumps({
        "roles": {m.id: nameservice_pb2.Role.Name(m.role) for m in reply.members},
        "indexed": [w.worker_id for w in index.workers],
    }))

asyncio.run(main())
"""


def test_chat_answer_equals_the_offline_engine(cluster, offline):
    assert offline == "The capital of France is Paris."
    client = _client(cluster)
    [model] = client.models.list().data
    assert model.id == "smollm2-135m-v1"
    out = client.chat.completions.create(
        model=model.id, messages=QUESTION, max_tokens=16, temperature=0
    )
    assert out.choices[0].message.content == offline


def test_scaled_to_two_prefill_and_two_decode_all_take_requests(cluster):
    cluster.up("--scale", "prefill=2", "--scale", "decode=2")
    deadline = time.monotonic() + 300
    while True:
        [master] = cluster.containers("master")
        state = json.loads(cluster.python(master, _MEMBERS))
        workers = {i for i, r in state["roles"].items() if r in ("ROLE_PREFILL", "ROLE_DECODE")}
        if len(workers) == 4 and workers <= set(state["indexed"]):
            break
        assert time.monotonic() < deadline, state
        time.sleep(2)
    assert sorted(state["roles"][w] for w in workers) == ["ROLE_DECODE"] * 2 + ["ROLE_PREFILL"] * 2
    cluster.reference = _streams(cluster)  # the unkilled texts for the fault tests below

    def idle() -> list[tuple[str, str]]:
        """The workers that took no request yet."""
        return [
            (service, container)
            for service, metric in (
                ("prefill", "rtp:prefix_cache_queries_total"),
                ("decode", "rtp:kv_transfer_blocks_total"),
            )
            for container in cluster.containers(service)
            if not any(
                v > 0
                for k, v in json.loads(cluster.python(container, _COUNTS)).items()
                if k.startswith(metric)
            )
        ]

    for _ in range(2):  # a new worker's cost is unfitted until it has run: a round or two
        if not idle():
            break
        assert _streams(cluster) == cluster.reference
    assert idle() == []
    assert len(cluster.containers("prefill")) == len(cluster.containers("decode")) == 2


def _under_streams(cluster: Project, fault) -> list[tuple[str, str]]:
    """The 8 streams, with `fault(container)` done to a decode container holding some of them
    once every stream has started."""
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        decode = cluster.containers("decode")
        texts = pool.submit(_streams, cluster, started)
        assert started.wait(timeout=300)
        holding = {c: _running(cluster, c) for c in decode}
        victim = max(holding, key=holding.get)
        assert holding[victim] > 0, holding
        fault(victim)
        return texts.result(timeout=600)


def test_a_decode_container_sigkilled_under_streams_loses_none(cluster):
    reference = cluster.reference or _streams(cluster)
    texts = _under_streams(
        cluster, lambda c: subprocess.run(["docker", "kill", c], check=True, capture_output=True)
    )
    assert texts == reference
    cluster.up("--scale", "prefill=2", "--scale", "decode=2")  # the killed one back
    cluster.wait_healthy("decode")


def test_a_decode_container_stopped_under_streams_drains(cluster):
    reference = cluster.reference or _streams(cluster)
    stopped: list[str] = []

    def stop(container: str) -> None:
        subprocess.run(["docker", "stop", "-t", "20", container], check=True, capture_output=True)
        stopped.append(container)

    assert _under_streams(cluster, stop) == reference
    state = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.ExitCode}}", stopped[0]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert state == "0"  # it exited on SIGTERM after draining, not killed after the grace


def test_down_leaves_nothing_of_the_project(cluster):
    cluster.down()
    assert cluster.leftovers() == {"containers": [], "networks": [], "volumes": []}


def test_the_secure_variant_refuses_a_request_without_the_key(images, tmp_path, offline):
    if os.geteuid() != 0:
        pytest.skip("the secrets must belong to the images' user (uid 10001): needs root")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_secrets.py"), "--out", str(tmp_path / "secrets")],
        check=True,
        capture_output=True,
    )
    for path in [tmp_path / "secrets", *(tmp_path / "secrets").iterdir()]:
        os.chown(path, 10001, 10001)
    key = (tmp_path / "secrets/api_keys").read_text().split()[0]
    project = Project(
        f"rtpsecure{os.getpid()}", ["compose.yaml", "compose.secure.yaml"], directory=tmp_path
    )
    try:
        project.up()
        body = {"model": "smollm2-135m-v1", "messages": QUESTION, "max_tokens": 16}
        refused = httpx.post(project.url + "/v1/chat/completions", json=body, timeout=60)
        assert refused.status_code == 401
        client = openai.OpenAI(base_url=project.url + "/v1", api_key=key, max_retries=0)
        out = client.chat.completions.create(
            model="smollm2-135m-v1", messages=QUESTION, max_tokens=16, temperature=0
        )
        assert out.choices[0].message.content == offline  # through mTLS, NATS and Redis auth
    finally:
        project.down()
    assert project.leftovers() == {"containers": [], "networks": [], "volumes": []}
