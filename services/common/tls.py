"""Mutual TLS for the cluster's internal gRPC: who may call a worker, the master, the cache
or the nameservice.

Every service serves with its certificate and requires the caller's, signed by the cluster
CA (`--tls-ca`); every client presents its own certificate and verifies the server's against
the same CA. So a certificate from that CA is what makes a process a cluster member; without
one (or with one from another CA) the TLS handshake fails before any RPC runs.

Transport security is a property of the process, set once at start (`grpc_util.use_tls`),
like its tracing: every server and channel the process makes uses it. Where no flags gave
it, the RTP_TLS_* environment does, so a container's health probe speaks TLS too.

Certificates name hosts: `rtp-serve up --tls` issues one for 127.0.0.1/localhost. Where
members have changing addresses (Kubernetes pods), issue one for a fixed DNS name and give
`--tls-server-name NAME`: clients then verify every server against that name.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc

from rtp_serve.services.common.env import env


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert: bytes  # PEM certificate chain of this process
    key: bytes  # PEM private key
    ca: bytes  # PEM CA certificate(s) that sign every cluster member
    server_name: str | None = None  # verify servers against this name, not their host

    @classmethod
    def load(
        cls, cert: str | None, key: str | None, ca: str | None, server_name: str | None = None
    ) -> TlsConfig | None:
        """From PEM files; None when none is given. All three or none: ValueError else."""
        given = [f for f in (cert, key, ca) if f]
        if not given:
            return None
        if len(given) != 3:
            raise ValueError("mutual TLS needs all of --tls-cert, --tls-key and --tls-ca")
        return cls(
            Path(cert).read_bytes(), Path(key).read_bytes(), Path(ca).read_bytes(), server_name
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    for name, what in (
        ("cert", "this service's certificate (PEM)"),
        ("key", "its private key (PEM)"),
        ("ca", "the cluster CA (PEM): callers must present a certificate it signed"),
    ):
        p.add_argument(
            f"--tls-{name}",
            default=env(f"tls_{name}"),
            metavar="FILE",
            help=f"mutual TLS on internal gRPC: {what}; all three or none (default: plaintext)",
        )
    p.add_argument(
        "--tls-server-name",
        default=env("tls_server_name"),
        help="verify every server's certificate against this DNS name instead of its host",
    )


def from_args(args: argparse.Namespace) -> TlsConfig | None:
    return TlsConfig.load(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


def from_env() -> TlsConfig | None:
    """From RTP_TLS_CERT, RTP_TLS_KEY, RTP_TLS_CA (and RTP_TLS_SERVER_NAME)."""
    return TlsConfig.load(env("tls_cert"), env("tls_key"), env("tls_ca"), env("tls_server_name"))
