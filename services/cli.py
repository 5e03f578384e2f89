"""`rtp-serve` command line: one sub-command per tool or service."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _make_model(args: argparse.Namespace) -> int:
    from engine.make_model import build_model

    path = build_model(args.preset, args.out, max_shard_bytes=args.max_shard_mib << 20)
    logging.getLogger("rtp-serve").info("model %s written to %s", args.preset, path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    for out in llm.generate(args.prompt, params):
        line = {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}
        sys.stdout.write(json.dumps(line) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine.make_model import DEFAULT_PRESET, PRESETS

    parser = argparse.ArgumentParser(prog="rtp-serve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a local HuggingFace-format test checkpoint")
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--out", required=True)
    p.add_argument("--max-shard-mib", type=int, default=256, help="shard weights above this size")
    p.set_defaults(func=_make_model)

    p = sub.add_parser("generate", help="offline generation with the in-process engine")
    p.add_argument("prompt", nargs="+")
    p.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
