"""The RTP_* environment variables every flag defaults from: its own module, so flags.py and
tls.py (whose flags flags.py adds) both import it without importing each other."""

from __future__ import annotations

import os


def env(name: str, default: str | None = None) -> str | None:
    """Value of RTP_<NAME> (upper-cased, dashes as underscores); else the contents of the
    file RTP_<NAME>_FILE names (how compose and Kubernetes secrets arrive: as files, kept
    out of the environment), without its trailing newline; else `default`."""
    var = "RTP_" + name.upper().replace("-", "_")
    if var in os.environ:
        return os.environ[var]
    path = os.environ.get(var + "_FILE")
    if path:
        with open(path) as f:
            return f.read().rstrip("\r\n")
    return default
