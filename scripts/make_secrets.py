"""Generate a cluster's secrets as files, for compose.secure.yaml or Kubernetes Secrets.

    python scripts/make_secrets.py [--out secrets]

Writes (mode 0600, into a directory git ignores; nothing here is ever committed):

    api_keys          one frontend API key per line        metrics_key   /metrics key
    nats_token        the NATS token                       nats.conf     nats-server's auth
    redis_password    the Redis password                   redis.conf    redis-server's auth
    kv_integrity_key  the workers' KV HMAC key
    ca.pem, cluster.pem, cluster-key.pem   mutual TLS, SAN rtp-serve.internal (give every
                      service RTP_TLS_SERVER_NAME=rtp-serve.internal), localhost, 127.0.0.1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rtp_serve.services.launcher.certs import issue_cluster_certs  # noqa: E402

SERVER_NAME = "rtp-serve.internal"
log = logging.getLogger("make_secrets")


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def main() -> int:
    logging.basicConfig(level="INFO", format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="secrets")
    out = Path(p.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    nats_token, redis_password = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    _write(out / "api_keys", f"sk-{secrets.token_urlsafe(32)}\n")
    _write(out / "metrics_key", secrets.token_urlsafe(32))
    _write(out / "nats_token", nats_token)
    _write(out / "nats.conf", f"authorization {{ token: {json.dumps(nats_token)} }}\n")
    _write(out / "redis_password", redis_password)
    _write(out / "redis.conf", f"requirepass {json.dumps(redis_password)}\n")
    _write(out / "kv_integrity_key", secrets.token_urlsafe(32))
    issue_cluster_certs(out, "rtp-serve", dns_names=(SERVER_NAME, "localhost"))
    log.info("secrets written to %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
