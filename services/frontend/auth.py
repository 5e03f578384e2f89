"""API keys for the frontend: who may use the model, and who may read its metrics.

    Authorization: Bearer <key>

    path                 no key configured   API keys only     API keys + metrics key
    /health, /ready      open                open              open
    /metrics             open                an API key        the metrics key
    everything else      open                an API key        an API key

Keys come from `--api-key` (repeatable; without it RTP_API_KEY, or RTP_API_KEYS
comma-separated) and `--api-key-file` (one per line; blank lines and `#` comments skipped); the metrics key from
`--metrics-key` / RTP_METRICS_KEY. Only SHA-256 digests of the keys are kept, and a
presented key is compared with every one of them in constant time (`hmac.compare_digest`),
so neither the comparison's time nor a log line tells anything about a key. The gRPC
ingress (rtp.v1.Frontend) takes the same header as `authorization` metadata.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from rtp_serve.services.common.env import env
from rtp_serve.services.frontend.errors import ErrorKind, FrontendError

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ready"})  # probes: they tell nothing about the model
METRICS_PATH = "/metrics"
_BEARER = "bearer "


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, slots=True)
class ApiKeys:
    api: tuple[bytes, ...] = ()  # digests of the API keys
    metrics: bytes | None = None  # digest of the metrics key

    @classmethod
    def of(cls, keys: Iterable[str], metrics_key: str | None = None) -> ApiKeys:
        digests = tuple(dict.fromkeys(_digest(k) for k in keys if k))
        return cls(digests, _digest(metrics_key) if metrics_key else None)

    @property
    def enabled(self) -> bool:
        return bool(self.api) or self.metrics is not None

    def allows(self, path: str, authorization: str | None) -> bool:
        """May a request for `path` with this Authorization header (or metadata) go on?"""
        if path in OPEN_PATHS or not self.enabled:
            return True
        if path == METRICS_PATH and self.metrics is not None:
            wanted: tuple[bytes, ...] = (self.metrics,)
        else:
            wanted = self.api
        presented = bearer(authorization)
        if presented is None:
            return False
        digest = _digest(presented)
        # No early exit: every configured key is compared, each in constant time.
        ok = False
        for key in wanted:
            ok |= hmac.compare_digest(digest, key)
        return ok


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


def middleware(keys: ApiKeys) -> Any:
    """aiohttp middleware: 401 with an OpenAI error body unless `keys` allow the request."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
        if keys.allows(request.path, request.headers.get("Authorization")):
            return await handler(request)
        exc = unauthorized()
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
        help="the key GET /metrics needs (default: any API key; open if there is none)",
    )


def from_args(args: argparse.Namespace) -> ApiKeys:
    keys = list(args.api_key or [])
    if not keys:  # the environment is the flags' default, as for every flag
        # Read directly: RTP_API_KEY_FILE names --api-key-file, not a file holding one key.
        keys = [os.environ.get("RTP_API_KEY", ""), *os.environ.get("RTP_API_KEYS", "").split(",")]
    if args.api_key_file:
        keys += read_key_file(Path(args.api_key_file))
    api_keys = ApiKeys.of((k.strip() for k in keys), args.metrics_key)
    if not api_keys.api:
        log.warning("no API key configured: anyone who reaches the frontend may use the model")
    else:
        log.info("API keys required: %d configured", len(api_keys.api))
    return api_keys


def read_key_file(path: Path) -> list[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]
