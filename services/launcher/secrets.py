"""The secrets of a launched cluster, and which service gets which.

    service       gets
    nameservice   NATS token, TLS
    master        NATS token, TLS
    cache         NATS token (its index feed), Redis password, TLS
    workers       NATS token, KV integrity key, TLS
    frontend      API keys, metrics key, admin key, TLS

Secrets travel to each child as RTP_* environment variables, never on its command line
(which `ps` shows to every user), and each service gets only the ones it uses.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rtp_serve.services.launcher.certs import CertFiles

WORKERS = ("prefill", "decode", "fused", "sim-worker")
_NATS = ("nameservice", "master", "cache", "planner", *WORKERS)  # every service on the bus


@dataclass(frozen=True, slots=True)
class ClusterSecrets:
    api_keys: tuple[str, ...] = ()
    metrics_key: str | None = None
    admin_key: str | None = None
    nats_token: str | None = None
    redis_password: str | None = None
    kv_integrity_key: str | None = None
    tls: CertFiles | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, tls: CertFiles | None) -> ClusterSecrets:
        keys = tuple(args.api_key or ())
        if any("," in k for k in keys):
            raise ValueError("an API key must not contain ',' (use --api-key-file)")
        return cls(
            keys,
            args.metrics_key,
            args.admin_key,
            args.nats_token,
            args.redis_password,
            args.kv_integrity_key,
            tls,
        )

    def env(self, service: str) -> dict[str, str]:
        """The RTP_* variables `service` (a sub-command name) starts with."""
        out: dict[str, str] = {}
        if self.tls is not None:
            out |= {
                "RTP_TLS_CERT": str(self.tls.cert),
                "RTP_TLS_KEY": str(self.tls.key),
                "RTP_TLS_CA": str(self.tls.ca),
            }
        if self.nats_token and service in _NATS:
            out["RTP_NATS_TOKEN"] = self.nats_token
        if self.redis_password and service == "cache":
            out["RTP_REDIS_PASSWORD"] = self.redis_password
        if self.kv_integrity_key and service in (*WORKERS, "planner"):  # the planner's workers
            out["RTP_KV_INTEGRITY_KEY"] = self.kv_integrity_key
        if self.metrics_key and service == "planner":  # it reads the frontends' /metrics
            out["RTP_METRICS_KEY"] = self.metrics_key
        if service == "frontend":
            if self.api_keys:
                out["RTP_API_KEYS"] = ",".join(self.api_keys)
            if self.metrics_key:
                out["RTP_METRICS_KEY"] = self.metrics_key
            if self.admin_key:
                out["RTP_ADMIN_KEY"] = self.admin_key
        return out
