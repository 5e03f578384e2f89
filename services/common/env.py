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


def env_flag(name: str, default: bool) -> bool:
    """A yes/no flag's default from RTP_<NAME>: 1/true/yes or 0/false/no (any case); any
    other value is refused by name."""
    value = env(name)
    if value is None:
        return default
    if value.strip().lower() in ("1", "true", "yes"):
        return True
    if value.strip().lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"RTP_{name.upper()}={value!r}: expected 1/true/yes or 0/false/no")
