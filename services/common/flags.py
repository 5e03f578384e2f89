"""Command-line flags shared by every service; each defaults from an RTP_* environment
variable, so compose and Kubernetes configure services by environment alone."""

from __future__ import annotations

import argparse
import socket

from rtp_serve.core.dtypes import KV_DTYPES, MODEL_DTYPES, WEIGHT_DTYPES
from rtp_serve.services.common.env import env
from rtp_serve.services.common.tls import add_tls_flags

# --advertise-host value meaning "this machine's own address": in a container that is the
# container's address on its network, so every replica of a scaled service registers a
# distinct, reachable address without per-replica configuration.
AUTO_HOST = "auto"


# --model of the launcher and the workers: engine.make_model.default_model() when unset.
DEFAULT_MODEL_HELP = (
    "default: smollm2-135m, built once into $RTP_SERVE_MODEL_CACHE; tiny-llama where it "
    "cannot be downloaded"
)


def int_or_none(value: str | None) -> int | None:
    """An optional integer flag's default from its environment variable (unset or empty:
    None)."""
    return int(value) if value else None


def add_common_flags(
    p: argparse.ArgumentParser, *, nameservice: bool = True, nats: bool = True
) -> None:
    p.add_argument("--host", default=env("host", "127.0.0.1"), help="address to bind")
    p.add_argument("--port", type=int, default=int(env("port", "0")), help="port (0: any free)")
    p.add_argument(
        "--advertise-host",
        default=env("advertise_host"),
        help=f"host others use to reach this instance (default: --host; {AUTO_HOST!r}: "
        "this machine's address, as its hostname resolves)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("metrics_port", "0")),
        help="Prometheus metrics port (0: any free; registered with the nameservice); the "
        "frontend serves /metrics on its HTTP --port instead",
    )
    p.add_argument("--namespace", default=env("namespace", "default"))
    p.add_argument("--log-level", default=env("log_level", "INFO"))
    p.add_argument("--log-format", choices=("text", "json"), default=env("log_format", "text"))
    if nameservice:
        p.add_argument(
            "--nameservice", default=env("nameservice"), help="host:port of the nameservice"
        )
    if nats:
        p.add_argument("--nats-url", default=env("nats_url"), help="nats://host:port (optional)")
        p.add_argument(
            "--nats-token",
            default=env("nats_token"),
            help="NATS auth token (or put user:password in --nats-url)",
        )
    add_tls_flags(p)


DEFAULT_BLOCK_SIZE = 16


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model's numerics and KV block size, for the workers (and the launcher, which
    passes them on). They decide the block hash keys: the frontend learns them from the
    workers' registration, so only the workers take them."""
    p.add_argument(
        "--dtype",
        default=env("dtype", "auto"),
        choices=MODEL_DTYPES,
        help="compute dtype; auto: the checkpoint's (config.json torch_dtype)",
    )
    p.add_argument(
        "--weight-dtype",
        default=env("weight_dtype", "auto"),
        choices=WEIGHT_DTYPES,
        help="auto: projections in --dtype; int8: weight-only INT8 per output channel, "
        "quantized at load (half of bf16's bytes for decode; ~1%% higher perplexity); "
        "w8a8: INT8 weights and per-token INT8 activations in integer GEMMs (CPU; VNNI)",
    )
    p.add_argument(
        "--kv-dtype",
        default=env("kv_dtype", "auto"),
        choices=KV_DTYPES,
        help="KV cache storage; auto: --dtype (bfloat16 under float32 holds 2x the tokens)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=int(env("block_size", str(DEFAULT_BLOCK_SIZE))),
        help="tokens per KV cache block (the unit of prefix caching and KV transfer)",
    )


DEFAULT_DRAIN_TIMEOUT_S = 5.0


def drain_timeout(value: str) -> float:
    """`--drain-timeout`: seconds >= 0."""
    seconds = float(value)
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value}")
    return seconds


def add_drain_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--drain-timeout",
        type=drain_timeout,
        default=drain_timeout(env("drain_timeout", str(DEFAULT_DRAIN_TIMEOUT_S))),
        help=f"on SIGTERM: stop taking new requests, let {what} finish for up to this many "
        "seconds, then end what is left and exit",
    )


def advertised(args: argparse.Namespace, port: int) -> str:
    host = args.advertise_host or args.host
    if host == AUTO_HOST:
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


def redact(url: str) -> str:
    """`url` without the credentials it may carry (scheme://user:password@host -> host): for
    logs, which never show a secret."""
    scheme, sep, rest = url.rpartition("://")
    return scheme + sep + rest.rpartition("@")[2]


def _lora_flag(value: str) -> tuple[str, str]:
    from rtp_serve.core.peft_config import AdapterError, parse_lora_flag

    try:
        return parse_lora_flag(value)
    except AdapterError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_lora_flags(p: argparse.ArgumentParser, *, max_loras: bool = True) -> None:
    """--lora NAME=DIR (repeatable; RTP_LORA: comma-separated), and --max-loras."""
    default = [_lora_flag(v) for v in (env("lora") or "").split(",") if v]
    p.add_argument(
        "--lora",
        dest="loras",
        type=_lora_flag,
        action="append",
        default=default,
        metavar="NAME=DIR",
        help="serve the PEFT LoRA adapter in DIR as model NAME (repeatable); more can be "
        "loaded at run time (POST /v1/load_lora_adapter)",
    )
    if max_loras:
        p.add_argument(
            "--max-loras",
            type=int,
            default=int(env("max_loras", "4")),
            help="LoRA adapters resident at once (LRU-swapped from disk); also the most "
            "distinct adapters one batch runs",
        )
