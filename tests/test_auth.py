"""Frontend API keys (services/frontend/auth.py), exactly: which path needs which key, how a
header is read, and where keys come from. Every endpoint over HTTP against a real cluster:
tests/test_security_cluster.py."""

from __future__ import annotations

import argparse
import logging

import pytest

from rtp_serve.services.common.env import env
from rtp_serve.services.frontend import auth
from rtp_serve.services.frontend.auth import ApiKeys

API = "/v1/completions"


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    auth.add_auth_flags(p)
    return p.parse_args(argv)


def test_the_access_table():
    header = {k: f"Bearer {k}" for k in ("a", "b", "m", "x")}
    table = {
        # keys configured: (path, header) -> allowed
        ApiKeys.of([]): {
            (API, None): True,
            ("/metrics", None): True,
            ("/v1/load_lora_adapter", None): False,  # no admin key: disabled
        },
        ApiKeys.of(["a", "b"]): {
            (API, None): False,
            (API, header["x"]): False,
            (API, header["a"]): True,
            (API, header["b"]): True,
            ("/metrics", None): False,
            ("/metrics", header["a"]): True,
            ("/health", None): True,
            ("/ready", None): True,
        },
        ApiKeys.of(["a"], metrics_key="m"): {
            (API, header["m"]): False,
            (API, header["a"]): True,
            ("/metrics", header["a"]): False,
            ("/metrics", header["m"]): True,
            ("/health", None): True,
        },
        ApiKeys.of([], metrics_key="m"): {
            (API, None): True,  # the metrics key guards /metrics only
            ("/metrics", None): False,
            ("/metrics", header["m"]): True,
        },
        ApiKeys.of(["a"], admin_key="x"): {
            ("/v1/load_lora_adapter", header["a"]): False,  # an API key is no admin key
            ("/v1/load_lora_adapter", header["x"]): True,
            ("/v1/unload_lora_adapter", header["x"]): True,
            (API, header["x"]): False,
        },
    }
    for keys, cases in table.items():
        for (path, authorization), allowed in cases.items():
            assert keys.allows(path, authorization) is allowed, (keys, path, authorization)


def test_the_bearer_header():
    assert auth.bearer("Bearer k1") == "k1"
    assert auth.bearer("bearer  k1 ") == "k1"
    for bad in (None, "", "k1", "Basic k1", "Bearer", "Bearer   "):
        assert auth.bearer(bad) is None, bad
    keys = ApiKeys.of(["k1"])
    assert not keys.allows(API, "k1") and not keys.allows(API, "Bearer k1x")
    assert not keys.allows(API, "Bearer k")


def test_only_digests_are_kept():
    keys = ApiKeys.of(["sk-secret", "sk-secret"], metrics_key="mk")
    assert len(keys.api) == 1  # duplicates collapse
    assert "sk-secret" not in repr(keys) and "mk" not in repr(keys).replace("metrics", "")


def test_keys_from_flags_file_and_environment(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("RTP_API_KEY", raising=False)
    monkeypatch.delenv("RTP_API_KEYS", raising=False)
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\n\nfile-1\n  file-2  \n")
    keys = auth.from_args(_args("--api-key", "flag-1", "--api-key-file", str(keys_file)))
    for key in ("flag-1", "file-1", "file-2"):
        assert keys.allows(API, f"Bearer {key}"), key
    assert not keys.allows(API, "Bearer # comment")

    monkeypatch.setenv("RTP_API_KEYS", "env-1,env-2")
    monkeypatch.setenv("RTP_API_KEY", "env-0")
    keys = auth.from_args(_args())
    assert all(keys.allows(API, f"Bearer env-{i}") for i in range(3))
    keys = auth.from_args(_args("--api-key", "flag-1"))  # flags win over the environment
    assert not keys.allows(API, "Bearer env-1") and keys.allows(API, "Bearer flag-1")

    monkeypatch.delenv("RTP_API_KEY")
    monkeypatch.delenv("RTP_API_KEYS")
    with caplog.at_level(logging.WARNING, logger="rtp_serve.services.frontend.auth"):
        assert not auth.from_args(_args()).enabled
    assert "no API key configured" in caplog.text


def test_secrets_read_from_files(tmp_path, monkeypatch):
    """RTP_<X>_FILE: how compose and Kubernetes secrets reach a flag."""
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    monkeypatch.delenv("RTP_NATS_TOKEN", raising=False)
    monkeypatch.setenv("RTP_NATS_TOKEN_FILE", str(secret))
    assert env("nats_token") == "s3cret"
    monkeypatch.setenv("RTP_NATS_TOKEN", "direct")  # the variable itself wins
    assert env("nats_token") == "direct"


def test_unauthorized_is_an_openai_error():
    exc = auth.unauthorized()
    assert exc.kind.http_status == 401
    body = exc.body()["error"]
    assert body["type"] == "invalid_request_error" and body["code"] == "invalid_api_key"


def test_key_entries_carry_a_priority_floor(monkeypatch):
    """`KEY priority=N`: the most urgent priority the key may ask for (lower runs first);
    other keys and an open API get --priority-floor (default 0)."""
    monkeypatch.setenv("RTP_API_KEYS", "ops priority=-5,batch priority=10,plain")
    keys = auth.from_args(_args())
    assert keys.allows(API, "Bearer ops") and not keys.allows(API, "Bearer ops priority=-5")
    floors = {k: keys.priority_floor(f"Bearer {k}") for k in ("ops", "batch", "plain", "x")}
    assert floors == {"ops": -5, "batch": 10, "plain": 0, "x": 0}
    assert (
        auth.from_args(_args("--api-key", "k", "--priority-floor", "-3")).priority_floor("Bearer k")
        == -3
    )
    assert ApiKeys.of([]).priority_floor(None) == 0
    for bad in ("k prio=1", "k priority=high"):
        with pytest.raises(ValueError):
            auth.from_args(_args("--api-key", bad))
