"""The Docker actuator: scales compose services' containers through the Docker Engine API.

    scale up    start a container of the service that is stopped (ours first: its image,
                filesystem and page cache are warm), else create one cloned from the
                service's existing container, as `docker compose up --scale` would
    scale down  `docker stop` (SIGTERM, SIGKILL only after the drain timeout) the victims,
                else the newest; the container is kept, stopped, for the next scale-up

A role's containers are those labelled com.docker.compose.project=<project> and
com.docker.compose.service=<the role's service>. Each worker registers its container's own
address (RTP_ADVERTISE_HOST=auto), so a member id maps to its container by that address.
The SDK is blocking: every call runs in a thread.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import re
import socket
from collections.abc import Callable, Mapping, Sequence

from docker.client import DockerClient, from_env
from docker.errors import NotFound
from docker.models.containers import Container

from rtp_serve.services.planner.actuator import ROLES

log = logging.getLogger(__name__)

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"
ONEOFF_LABEL = "com.docker.compose.oneoff"  # `compose run` containers: never scaled
# Seconds a worker needs past its drain timeout to end the rest and exit (as the compose
# file's stop_grace_period and the pods' terminationGracePeriodSeconds allow).
EXIT_SLACK_S = 5.0
LIVE = ("running", "restarting")
STARTABLE = ("exited", "created")
# Network modes whose endpoints take no service alias (not user-defined networks).
NO_ALIAS_MODES = ("default", "bridge", "host", "none")


class DockerActuatorError(RuntimeError):
    pass


class DockerActuator:
    """Scales the containers of compose project `project`'s services. `services`: role ->
    compose service (default: the service named as the role). `locate`: member id -> the
    address it registered ("host:port"), or None (without it, victims are taken as
    addresses); victims not found are replaced by the newest containers.
    `drain_timeout_s`: the workers' --drain-timeout."""

    name = "docker"

    def __init__(
        self,
        project: str | None = None,
        services: Mapping[str, str] | None = None,
        *,
        locate: Callable[[str], str | None] | None = None,
        drain_timeout_s: float = 10.0,
        client: DockerClient | None = None,
    ) -> None:
        self.client = client or from_env()
        self.project = project or _own_project(self.client)
        self.services = {role: role for role in ROLES} | dict(services or {})
        self.locate = locate
        self.stop_timeout_s = drain_timeout_s + EXIT_SLACK_S
        self._stopping: dict[str, asyncio.Task[None]] = {}  # container id -> its stop
        self._stopped: list[str] = []  # ids this actuator stopped, oldest first
        self._lock = asyncio.Lock()

    async def replicas(self) -> dict[str, int]:
        counts = {}
        for role in ROLES:
            containers = await asyncio.to_thread(self._containers, self.services[role])
            counts[role] = len(self._live(containers))
        return counts

    async def scale(self, role: str, target: int, victims: Sequence[str] = ()) -> None:
        service = self.services[role]
        async with self._lock:
            containers = await asyncio.to_thread(self._containers, service)
            live = self._live(containers)
            if target > len(live):
                await asyncio.to_thread(self._start, service, containers, target - len(live))
            elif target < len(live):
                for c in self._choose(live, victims, len(live) - target):
                    log.info("docker: stopping %s (%s), drain up to %.0f s", c.name, role,
                             self.stop_timeout_s)  # fmt: skip
                    self._stopping[c.id] = asyncio.create_task(self._stop(c))

    async def close(self) -> None:
        """Waits for the stops under way (each bounded by the stop timeout); containers stay."""
        await asyncio.gather(*self._stopping.values(), return_exceptions=True)
        await asyncio.to_thread(self.client.close)

    # -- the blocking parts, run in threads ---------------------------------------------------
    def _containers(self, service: str) -> list[Container]:
        labels = [f"{PROJECT_LABEL}={self.project}", f"{SERVICE_LABEL}={service}"]
        found = self.client.containers.list(all=True, filters={"label": labels})
        return [c for c in found if c.labels.get(ONEOFF_LABEL, "False") != "True"]

    def _live(self, containers: list[Container]) -> list[Container]:
        return [c for c in containers if c.status in LIVE and c.id not in self._stopping]

    def _start(self, service: str, containers: list[Container], count: int) -> None:
        ours = {cid: n for n, cid in enumerate(self._stopped)}
        # Stopped ones first, ours before others (a planner restarted forgets what it
        # stopped; a stopped container of the service is still the fastest start).
        stopped = sorted((c for c in containers if c.status in STARTABLE), key=_age, reverse=True)
        stopped.sort(key=lambda c: -ours.get(c.id, -1))  # stable: ours, last stopped first
        for c in stopped[:count]:
            log.info("docker: starting stopped %s", c.name)
            c.start()
            if c.id in ours:
                self._stopped.remove(c.id)
            count -= 1
        if count <= 0:
            return
        if not containers:
            raise DockerActuatorError(
                f"compose service {service!r} of project {self.project!r} has no container: "
                f"the Docker actuator clones an existing one, so create it first "
                f"(docker compose -p {self.project} up -d {service})"
            )
        template = max(containers, key=lambda c: (c.status in LIVE, _age(c)))
        siblings = list(containers)
        for _ in range(count):
            clone = self._clone(template, siblings)
            clone.start()
            siblings.append(clone)

    def _clone(self, template: Container, siblings: list[Container]) -> Container:
        """A new container of the template's service, as compose would make it: same config,
        host config and networks (with the service's DNS alias), the next container number."""
        attrs = template.attrs
        project, service = self.project, template.labels[SERVICE_LABEL]
        number = 1 + max(int(c.labels.get(NUMBER_LABEL, "0")) for c in siblings)
        sep = "-" if template.name.startswith(f"{project}-{service}-") else "_"  # v2 : 1.29
        name = f"{project}{sep}{service}{sep}{number}"

        config = copy.deepcopy(attrs["Config"])
        for key in ("Hostname", "Domainname"):  # docker gives each its own (its short id)
            config.pop(key, None)
        config["Labels"] = {**config.get("Labels", {}), NUMBER_LABEL: str(number)}
        host = copy.deepcopy(attrs["HostConfig"])
        for bindings in (host.get("PortBindings") or {}).values():
            for b in bindings or ():
                b["HostPort"] = ""  # a fixed host port cannot be shared: any free one
        config["HostConfig"] = host
        mode = host.get("NetworkMode", "default")
        networks = dict(attrs["NetworkSettings"].get("Networks") or {})
        aliased = mode not in NO_ALIAS_MODES and not mode.startswith("container:")
        if aliased:
            config["NetworkingConfig"] = {"EndpointsConfig": {mode: {"Aliases": [service]}}}
        log.info("docker: creating %s from %s", name, template.name)
        created = self.client.api.create_container_from_config(config, name=name)
        for net in networks:  # the others (the API takes one endpoint at create)
            if aliased and net != mode:
                self.client.api.connect_container_to_network(created["Id"], net, aliases=[service])
        return self.client.containers.get(created["Id"])

    def _choose(self, live: list[Container], victims: Sequence[str], count: int) -> list:
        """The `count` containers to stop: the victims' (by address), then the newest."""
        by_host = {key: c for c in live for key in _hosts(c)}
        chosen: list[Container] = []
        for member in victims:
            address = self.locate(member) if self.locate else member  # else: an address
            c = by_host.get(_host_of(address)) if address else None
            if c is not None and c not in chosen:
                chosen.append(c)
        rest = sorted((c for c in live if c not in chosen), key=_age, reverse=True)
        return (chosen + rest)[:count]

    async def _stop(self, container: Container) -> None:
        # The container's own stop timeout (compose's stop_grace_period) when it is longer.
        timeout = max(self.stop_timeout_s, container.attrs["Config"].get("StopTimeout") or 0)
        try:
            await asyncio.to_thread(container.stop, timeout=math.ceil(timeout))
            self._stopped.append(container.id)
            log.info("docker: stopped %s", container.name)
        except NotFound:
            log.warning("docker: %s vanished while stopping", container.name)
        finally:
            self._stopping.pop(container.id, None)


def _age(c: Container) -> tuple[str, str]:
    """Sort key, ascending from the least recently started (then created) container. Docker's
    RFC 3339 times drop the fraction's trailing zeros: padded, they compare as strings."""

    def stamp(value: str) -> str:
        whole, _, frac = value.rstrip("Z").partition(".")
        return whole + frac.ljust(9, "0")

    return stamp(c.attrs["State"].get("StartedAt", "")), stamp(c.attrs["Created"])


def _hosts(c: Container) -> set[str]:
    """What a worker in `c` may have registered as its host: an IP of the container, its
    hostname or its name."""
    nets = (c.attrs["NetworkSettings"].get("Networks") or {}).values()
    ips = {n.get(k) for n in nets for k in ("IPAddress", "GlobalIPv6Address")}
    return {h for h in ips | {c.attrs["Config"].get("Hostname"), c.name, c.id[:12]} if h}


def _host_of(address: str) -> str:
    host = re.sub(r":\d+$", "", address.strip())
    return host.strip("[]")


def _own_project(client: DockerClient) -> str:
    """The compose project of the container this planner runs in (its hostname is its id)."""
    try:
        return client.containers.get(socket.gethostname()).labels[PROJECT_LABEL]
    except (NotFound, KeyError):
        raise DockerActuatorError(
            "no compose project given and this planner does not run in a compose container: "
            "pass the project name (docker compose ls)"
        ) from None
