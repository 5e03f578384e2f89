"""The planner's Docker actuator against a real Docker engine and a real compose project.

A compose project in tmp_path runs one service whose process traps SIGTERM, "drains" for
DRAIN_S seconds and exits 0, as a worker does (services/worker/drain.py). DockerActuator
scales it 1 -> 3 -> 1 -> 0 -> 1: the two new containers are compose's own kind (labels,
network alias, config); scale-down stops the victim named by member id, then the newest,
with SIGTERM and a wait through the drain (exit 0 and "drained" in the logs, not SIGKILL's
137); scale-up from 0 restarts a stopped container rather than creating one. No rtp-serve
image is needed: any image with /bin/sh (the base docker/build-images.sh makes will do).

Skips only where no Docker engine answers; .ci/run starts one.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DRAIN_S = 2
SERVICE = "dec"  # the compose service the decode role maps to: not the role's own name
# Images with /bin/sh, best first: the base images docker/build-images.sh makes or pulls.
IMAGES = (
    "rtp-serve-python:local",
    "rtp-serve-python:3.11-bookworm",
    "python:3.11-slim",
    "rtp-serve-debian:bookworm",
    "rtp-serve-slim:latest",
)
# A worker's shutdown in miniature: SIGTERM -> drain -> exit 0. `wait` (not a foreground
# sleep) so the trap runs at once; `$` doubled for compose's interpolation.
WORKER_SH = (
    f"trap 'echo SIGTERM; sleep {DRAIN_S}; echo drained; exit 0' TERM; "
    "echo serving; while :; do sleep 1 & wait $$!; done"
)

docker = pytest.importorskip("docker", reason="NO DOCKER SDK: pip install -e '.[dev]'")


def _engine() -> docker.DockerClient | None:
    try:
        client = docker.from_env()
        client.ping()
        return client
    except docker.errors.DockerException:
        return None


if _engine() is None:
    pytest.skip(
        "NO DOCKER ENGINE: the Docker actuator's test did not run (apt-get install -y "
        "docker.io docker-compose debootstrap, then start dockerd as root; .ci/run does)",
        allow_module_level=True,
    )

from rtp_serve.services.planner.docker_actuator import (  # noqa: E402
    NUMBER_LABEL,
    DockerActuator,
    DockerActuatorError,
)


def _compose_cli() -> list[str]:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("NO COMPOSE: neither `docker compose` nor `docker-compose` is installed")


@pytest.fixture(scope="module")
def client() -> Iterator[docker.DockerClient]:
    c = _engine()
    yield c
    c.close()


@pytest.fixture(scope="module")
def image(client: docker.DockerClient) -> str:
    """A base image with /bin/sh; built by docker/build-images.sh when none is here yet."""
    for _ in range(2):
        for name in IMAGES:
            try:
                client.images.get(name)
                return name
            except docker.errors.ImageNotFound:
                pass
        out = subprocess.run(
            ["bash", str(ROOT / "docker/build-images.sh")],
            cwd=ROOT, capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-6000:]
    pytest.fail(f"docker/build-images.sh made none of {IMAGES}")


@pytest.fixture
def project(tmp_path: Path, image: str, client: docker.DockerClient) -> Iterator[str]:
    """A compose project of one running container of SERVICE, as `compose up -d` makes it."""
    name = f"rtpplanner{os.getpid()}"
    spec = {
        "version": "3.8",  # compose 1.29 wants one; v2 ignores it
        "services": {
            SERVICE: {
                "image": image,
                "entrypoint": ["sh", "-c", WORKER_SH],
                "environment": {"RTP_DRAIN_TIMEOUT": str(DRAIN_S)},
                "user": "1000:1000",
                "working_dir": "/tmp",
                "volumes": ["models:/models:ro"],
                "healthcheck": {"test": ["CMD", "true"], "interval": "5s"},
                "restart": "unless-stopped",
            }
        },
        "volumes": {"models": {}},
    }
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(spec))
    compose = [*_compose_cli(), "--project-directory", str(tmp_path), "-p", name]
    compose += ["-f", str(tmp_path / "compose.yaml")]

    def run(*args: str) -> None:
        out = subprocess.run([*compose, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"compose {args}:\n{out.stdout}\n{out.stderr}"

    try:
        run("up", "-d")
        yield name
    finally:
        try:
            run("down", "-v", "--remove-orphans", "--timeout", "1")
        finally:
            left = _remove_project(client, name)
    assert not left, f"compose down left {left}"


def _remove_project(client: docker.DockerClient, project: str) -> list[str]:
    """Removes whatever of `project` is left (containers, networks, volumes); their names."""
    label = {"label": f"com.docker.compose.project={project}"}
    left = []
    for c in client.containers.list(all=True, filters=label):
        left.append(c.name)
        c.remove(force=True)
    for item in [*client.networks.list(filters=label), *client.volumes.list(filters=label)]:
        left.append(item.name)
        item.remove()
    return left


def _service(client: docker.DockerClient, project: str) -> dict[str, docker.models.containers.Container]:  # fmt: skip
    labels = [f"com.docker.compose.project={project}", f"com.docker.compose.service={SERVICE}"]
    return {c.name: c for c in client.containers.list(all=True, filters={"label": labels})}


def _wait_exited(containers: list, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    for c in containers:
        while c.reload() or c.status != "exited":
            assert time.monotonic() < deadline, f"{c.name} is still {c.status}"
            time.sleep(0.2)


def _ip(container) -> str:
    [net] = container.attrs["NetworkSettings"]["Networks"].values()
    return net["IPAddress"]


def test_docker_actuator_scales_a_compose_service(
    client: docker.DockerClient, project: str
) -> None:
    [(first_name, first)] = _service(client, project).items()
    members: dict[str, str] = {}  # member id -> the address the worker would register
    actuator = DockerActuator(
        project, {"decode": SERVICE}, locate=members.get, drain_timeout_s=DRAIN_S
    )

    async def scenario() -> None:
        assert await actuator.replicas() == {"fused": 0, "prefill": 0, "decode": 1}
        with pytest.raises(DockerActuatorError, match="has no container"):
            await actuator.scale("prefill", 1)  # no `prefill` service to clone from

        # 1 -> 3: two clones, compose's kind of container.
        await actuator.scale("decode", 3)
        assert await actuator.replicas() == {"fused": 0, "prefill": 0, "decode": 3}
        containers = _service(client, project)
        sep = "-" if first_name.startswith(f"{project}-") else "_"
        assert sorted(containers) == [f"{project}{sep}{SERVICE}{sep}{n}" for n in (1, 2, 3)]
        template = first.attrs
        for name, c in containers.items():
            assert c.status == "running", name
            assert c.labels[NUMBER_LABEL] == name[-1]
            other = {k: v for k, v in c.labels.items() if k != NUMBER_LABEL}
            assert other == {k: v for k, v in first.labels.items() if k != NUMBER_LABEL}
            for key in ("Entrypoint", "Cmd", "Env", "User", "WorkingDir", "Healthcheck"):
                assert c.attrs["Config"][key] == template["Config"][key], (name, key)
            assert c.attrs["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
            mounts = {(m["Name"], m["Destination"], m["RW"]) for m in c.attrs["Mounts"]}
            assert mounts == {(f"{project}_models", "/models", False)}, name
            [(net, endpoint)] = c.attrs["NetworkSettings"]["Networks"].items()
            assert net == f"{project}_default" and SERVICE in endpoint["Aliases"], name
        # The service's DNS name answers with all three (what a worker's peers would use).
        resolved = first.exec_run(["getent", "ahostsv4", SERVICE]).output.decode().split()
        assert {_ip(c) for c in containers.values()} <= set(resolved)

        # 3 -> 1: the victim (the oldest, by its registered address), then the newest.
        by_number = {c.labels[NUMBER_LABEL]: c for c in containers.values()}
        members["decode-0001"] = f"{_ip(by_number['1'])}:50051"
        begun = time.monotonic()
        await actuator.scale("decode", 1, victims=["decode-0001", "decode-gone"])
        assert time.monotonic() - begun < DRAIN_S, "scale returns while the workers drain"
        assert await actuator.replicas() == {"fused": 0, "prefill": 0, "decode": 1}
        stopped = [by_number["1"], by_number["3"]]
        _wait_exited(stopped)
        assert time.monotonic() - begun >= DRAIN_S, "stopped before the drain was over"
        for c in stopped:
            assert c.attrs["State"]["ExitCode"] == 0, f"{c.name}: not a clean drain"
            assert c.logs().decode().split() == ["serving", "SIGTERM", "drained"], c.name
        by_number["2"].reload()
        assert by_number["2"].status == "running"

        # 1 -> 0 -> 1: the restart policy leaves a stopped one stopped; scale-up starts the
        # last stopped container again instead of creating a fourth.
        await actuator.scale("decode", 0)
        assert await actuator.replicas() == {"fused": 0, "prefill": 0, "decode": 0}
        _wait_exited([by_number["2"]])
        time.sleep(1)
        assert all(c.status == "exited" for c in _service(client, project).values())
        await actuator.scale("decode", 1)
        assert await actuator.replicas() == {"fused": 0, "prefill": 0, "decode": 1}
        after = _service(client, project)
        assert sorted(after) == sorted(containers), "a container was created, not restarted"
        assert [c.labels[NUMBER_LABEL] for c in after.values() if c.status == "running"] == ["2"]
        await actuator.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))
