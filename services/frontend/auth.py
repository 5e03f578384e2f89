"""API keys for the frontend: who may use the model, how urgent a priority each may ask
for, who may read its metrics, and who may load LoRA adapters.

    Authorization: Bearer <key>

    path                       no API key          API keys
    /health, /ready            open                open
    /metrics                   the metrics key if one is configured, else as the API
    /v1/load_lora_adapter,     the admin key (403 when none is configured)
      /v1/unload_lora_adapter
    everything else            open                an API key

The metrics key and the admin key guard their own paths only: configuring one never closes
(nor opens) the API. Keys come from `--api-key` (repeatable; without it RTP_API_KEY, or
RTP_API_KEYS comma-separated) and `--api-key-file` (one per line; blank lines and `#`
comments skipped); the metrics key from `--metrics-key` / RTP_METRICS_KEY; the admin key
from `--admin-key` / RTP_ADMIN_KEY.

An API key entry may carry, after whitespace, the most urgent `priority` its requests may
ask for (lower runs first): `sk-batch priority=10`, `sk-ops priority=-5`. A key without
one, and every client of a server without API keys, gets `--priority-floor` (default 0):
a request asking for a priority below its floor is a 403 naming `priority`. It may also name
its tenant and the tenant's weight and limits (`tenant=acme weight=2 tpm=60000`): the line
format is in tenants.py.

Only SHA-256 digests of the keys are kept, and a presented key is compared with every one
of them in constant time (`hmac.compare_digest`), so neither the comparison's time nor a log
line tells anything about a key. The gRPC ingress (rtp.v1.Frontend) takes the same header as
`authorization` metadata.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from rtp_serve.core.tenant import DEFAULT_TENANT
from rtp_serve.services.common.env import env
from rtp_serve.services.frontend.errors import ErrorKind, FrontendError
from rtp_serve.services.frontend.tenants import (
    DEFAULT_LABELS,
    KeyLine,
    TenantSpec,
    TenantTable,
    parse_line,
)

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ready"})  # probes: they tell nothing about the model
METRICS_PATH = "/metrics"
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
DEFAULT_PRIORITY_FLOOR = 0  # the default priority: nobody jumps the queue unless allowed
_BEARER = "bearer "


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _matches(digest: bytes, wanted: Iterable[bytes]) -> int:
    """The index of `digest` in `wanted`, or -1. No early exit: every key is compared, each
    in constant time."""
    found = -1
    for i, key in enumerate(wanted):
        if hmac.compare_digest(digest, key):
            found = i
    return found


@dataclass(frozen=True, slots=True)
class ApiKeys:
    api: tuple[bytes, ...] = ()  # digests of the API keys
    metrics: bytes | None = None  # digest of the metrics key
    admin: bytes | None = None  # digest of the admin key (LoRA endpoints)
    floors: tuple[int, ...] = ()  # per API key: the most urgent priority it may ask for
    default_floor: int = DEFAULT_PRIORITY_FLOOR  # keys without one, and an open API
    tenant_names: tuple[str, ...] = ()  # per API key: its tenant
    tenants: TenantTable = field(default_factory=TenantTable, compare=False)  # (dicts: unhashable)

    @classmethod
    def of(
        cls,
        keys: Iterable[str | tuple],
        metrics_key: str | None = None,
        admin_key: str | None = None,
        default_floor: int = DEFAULT_PRIORITY_FLOOR,
        tenant_labels: int = DEFAULT_LABELS,
    ) -> ApiKeys:
        """`keys`: keys, or KeyLines (key, priority floor or None for the default, tenant,
        tenant attributes), as parse_key makes them."""
        lines = [KeyLine(e) if isinstance(e, str) else KeyLine(*e) for e in keys]
        lines = [line for line in lines if line.key]
        by_digest: dict[bytes, KeyLine] = {_digest(line.key): line for line in lines}
        floors = (default_floor if ln.floor is None else ln.floor for ln in by_digest.values())
        return cls(
            tuple(by_digest),
            _digest(metrics_key) if metrics_key else None,
            _digest(admin_key) if admin_key else None,
            tuple(floors),
            default_floor,
            tuple(line.tenant for line in by_digest.values()),
            TenantTable.of(lines, tenant_labels),
        )

    @property
    def enabled(self) -> bool:
        """Whether the API (everything but the probes, metrics and admin paths) needs a key."""
        return bool(self.api)

    def refusal(self, path: str, authorization: str | None) -> FrontendError | None:
        """Why a request for `path` with this Authorization header (or metadata) may not go
        on (401: no or a wrong key; 403: the admin endpoints are disabled); None: it may."""
        if path in OPEN_PATHS:
            return None
        if path in ADMIN_PATHS:
            if self.admin is None:
                return forbidden(
                    "the LoRA admin endpoints are disabled: the frontend needs --admin-key "
                    "(and --lora-root)"
                )
            wanted: tuple[bytes, ...] = (self.admin,)
        elif path == METRICS_PATH and self.metrics is not None:
            wanted = (self.metrics,)
        elif not self.api:
            return None
        else:
            wanted = self.api
        presented = bearer(authorization)
        if presented is None or _matches(_digest(presented), wanted) < 0:
            return unauthorized()
        return None

    def allows(self, path: str, authorization: str | None) -> bool:
        """May a request for `path` with this Authorization header (or metadata) go on?"""
        return self.refusal(path, authorization) is None

    def priority_floor(self, authorization: str | None) -> int:
        """The most urgent priority a request with this (already admitted) header may ask."""
        presented = bearer(authorization)
        if not self.api or presented is None:
            return self.default_floor
        i = _matches(_digest(presented), self.api)
        return self.default_floor if i < 0 else self.floors[i]

    def tenant(self, authorization: str | None) -> TenantSpec:
        """The tenant of a request with this (already admitted) header: its key's, or the
        default tenant without keys."""
        presented = bearer(authorization)
        if not self.api or presented is None:
            return self.tenants.get(DEFAULT_TENANT)
        i = _matches(_digest(presented), self.api)
        return self.tenants.get(DEFAULT_TENANT if i < 0 else self.tenant_names[i])

    def check_priority(self, priority: int, authorization: str | None) -> None:
        """403 naming `priority` when it is more urgent (lower) than the key may ask for."""
        floor = self.priority_floor(authorization)
        if priority < floor:
            raise FrontendError(
                ErrorKind.FORBIDDEN,
                f"priority {priority} is more urgent than this key may ask for (the lowest "
                f"allowed is {floor}; lower runs first)",
                "priority",
                "priority_not_allowed",
            )


def bearer(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header; None for anything else."""
    if not authorization or authorization[: len(_BEARER)].lower() != _BEARER:
        return None
    return authorization[len(_BEARER) :].strip() or None


def unauthorized() -> FrontendError:
    return FrontendError(
        ErrorKind.UNAUTHORIZED,
        "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
        code="invalid_api_key",
    )


def forbidden(message: str, param: str | None = None) -> FrontendError:
    return FrontendError(ErrorKind.FORBIDDEN, message, param, "forbidden")


def middleware(keys: ApiKeys) -> Any:
    """aiohttp middleware: 401 (403) with an OpenAI error body unless `keys` allow the
    request."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
        exc = keys.refusal(request.path, request.headers.get("Authorization"))
        if exc is None:
            return await handler(request)
        headers = None
        if exc.kind == ErrorKind.UNAUTHORIZED:
            headers = {"WWW-Authenticate": 'Bearer realm="rtp-serve"'}
        return web.json_response(exc.body(), status=exc.kind.http_status, headers=headers)

    return authenticate


# -- configuration -------------------------------------------------------------------------
def add_auth_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="an API key clients send as 'Authorization: Bearer KEY' (repeatable; also "
        "RTP_API_KEY, or RTP_API_KEYS comma-separated); none at all: the API is open",
    )
    p.add_argument(
        "--api-key-file",
        default=env("api_key_file"),
        metavar="FILE",
        help="API keys, one per line (# comments)",
    )
    p.add_argument(
        "--metrics-key",
        default=env("metrics_key"),
        help="the key GET /metrics needs (default: as the API: any API key, open if there "
        "is none); it guards /metrics only",
    )
    p.add_argument(
        "--admin-key",
        default=env("admin_key"),
        help="the key the LoRA admin endpoints (/v1/load_lora_adapter, "
        "/v1/unload_lora_adapter) need; without it they are refused (403)",
    )
    p.add_argument(
        "--priority-floor",
        type=int,
        default=int(env("priority_floor", str(DEFAULT_PRIORITY_FLOOR))),
        help="the most urgent `priority` a request may ask for (lower runs first) unless its "
        "API key carries its own (KEY priority=N); below it: 403",
    )
    p.add_argument(
        "--frontend-replicas",
        type=int,
        default=int(env("frontend_replicas", "1")),
        help="frontend replicas behind the load balancer: each enforces 1/N of every "
        "tenant's limits (tpm=, rpm=, concurrency= in the key file)",
    )
    p.add_argument(
        "--tenant-labels",
        type=int,
        default=int(env("tenant_labels", str(DEFAULT_LABELS))),
        help="tenants with a metrics label of their own (the highest weights, then the "
        "first in the key file); the rest are counted as 'other'",
    )


def from_args(args: argparse.Namespace) -> ApiKeys:
    entries = list(args.api_key or [])
    if not entries:  # the environment is the flags' default, as for every flag
        # Read directly: RTP_API_KEY_FILE names --api-key-file, not a file holding one key.
        entries = [
            os.environ.get("RTP_API_KEY", ""),
            *os.environ.get("RTP_API_KEYS", "").split(","),
        ]
    if args.api_key_file:
        entries += read_key_file(Path(args.api_key_file))
    keys = [parse_key(e) for e in entries if e.strip()]
    api_keys = ApiKeys.of(
        keys, args.metrics_key, args.admin_key, args.priority_floor, args.tenant_labels
    )
    if not api_keys.api:
        log.warning("no API key configured: anyone who reaches the frontend may use the model")
    else:
        log.info("API keys required: %d configured", len(api_keys.api))
    return api_keys


def parse_key(entry: str) -> KeyLine:
    """`KEY [priority=N] [tenant=NAME ...]` -> KeyLine (tenants.py); ValueError for anything
    else, so a mistyped attribute stops the frontend at start."""
    return parse_line(entry)


def read_key_file(path: Path) -> list[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]
