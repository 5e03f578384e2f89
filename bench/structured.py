"""Structured-output overhead: tokens/s of json_schema requests vs unconstrained, side by side.

    python bench/structured.py [--model smollm2-135m] [--batches 1,16] [--new 64] [--reps 3]
                               [--threads 2]

Per batch size, the same chat prompts run three times on one engine: unconstrained
(ignore_eos, so every row makes exactly --new tokens); under a JSON schema with the grammar
masks computed beside the forward pass (json_schema, the engine's way); and the same with
them computed inline after it (json_inline, as before engine/grammar_masks.py). The schema's
outputs cannot end before --new tokens either (an array of at least 200 person objects:
strings with a length bound, bounded integers, enums), so all runs have the same rows in
every step and their rates compare directly. Reported: output tokens/s over the whole run
(prompt included) and over the decode steps alone, best of --reps, the ratios to
unconstrained (target >= 0.9), and the grammar's share of the critical path (the sampler's
wait for the masks plus applying them). The grammar is compiled before timing (the engine
caches it per schema); its one-off compile time is shown apart. Header: the CPU's ISA level
and flags; footer: the load average. Timings are wall-clock on a shared machine: compare
within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, where bench/engine.py and its
# siblings would shadow any top-level module of the same name.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from rtp_serve.engine import LLM, SamplingParams, StructuredOutputs  # noqa: E402
from rtp_serve.engine.outputs import OutputCollector  # noqa: E402
from rtp_serve.kernels.isa import cpu_isa  # noqa: E402
from rtp_serve.models.make_model import resolve_model  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 200}
QUESTIONS = [
    "List the people in the office as JSON.",
    "Give me a JSON array of users.",
    "Who works here? Answer in JSON.",
    "Make up some people, as JSON.",
]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, int]:
    """(whole-run tokens/s, decode-steps tokens/s, output tokens) for one batch."""
    engine = llm.engine
    ids = []
    for i, prompt in enumerate(prompts):
        request = engine.make_request(f"b{time.monotonic_ns()}-{i}", prompt, params)
        engine.add_request(request)
        ids.append(request.request_id)
    collectors = {rid: OutputCollector(rid, []) for rid in ids}
    start = time.perf_counter()
    first_done = None  # when every row has its first token (the prompts are computed)
    while engine.has_unfinished_requests():
        for out in engine.step():
            collectors[out.request_id].add(out)
        if first_done is None and all(c.token_ids for c in collectors.values()):
            first_done = time.perf_counter()
    end = time.perf_counter()
    tokens = sum(len(c.token_ids) for c in collectors.values())
    assert first_done is not None
    decode_tokens = tokens - len(prompts)
    return tokens / (end - start), decode_tokens / (end - first_done), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new", type=int, default=64, help="output tokens per request")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    model_dir = str(resolve_model(args.model))
    llm = LLM(model_dir, num_threads=args.threads, num_kv_blocks=1024)
    tok = llm.tokenizer
    isa = cpu_isa()
    print(f"model {model_dir}, threads {args.threads}, torch {torch.__version__}")
    print(f"cpu: {isa.describe()}")

    # The grammar's share of a step's critical path, measured where it lands: the sampler's
    # masking of the constrained rows (waiting for masks still being computed beside the
    # forward pass, or computing them inline, then applying them to the logits).
    sampler = llm.engine.runner.sampler
    masking = {"s": 0.0, "n": 0}
    mask_guided = sampler._mask_guided

    def timed_mask(logits, requests, masks):
        t = time.perf_counter()
        try:
            return mask_guided(logits, requests, masks)
        finally:
            masking["s"] += time.perf_counter() - t
            masking["n"] += any(r.guide is not None for r in requests)

    sampler._mask_guided = timed_mask
    schema = StructuredOutputs.json(SCHEMA)
    t = time.perf_counter()
    llm.engine.grammars.guide(schema)  # tokenizer tables + this schema, once per engine
    print(f"grammar: first compile {1e3 * (time.perf_counter() - t):.0f} ms (tokenizer included)")
    constrained = SamplingParams(max_tokens=args.new, temperature=0.0, structured=schema)
    modes = {
        "unconstrained": SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True),
        "json_schema": constrained,
        # The same, with the masks computed inline after the forward pass (as before they
        # moved beside it, engine/grammar_masks.py): the reference for that change.
        "json_inline": constrained,
    }
    masks = llm.engine.runner.masks
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        chats = [
            tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
            for i in range(batch)
        ]
        prompts = [tok.encode(c, add_special_tokens=False) for c in chats]
        best = {m: (0.0, 0.0) for m in modes}
        run(llm, prompts[:1], modes["json_schema"])  # warm-up
        mask_ms = {}
        for _ in range(args.reps):  # alternate, so drifting machine load hits both alike
            for mode, params in modes.items():
                masks.background = mode != "json_inline"
                masking.update(s=0.0, n=0)
                whole, decode, tokens = run(llm, prompts, params)
                ms = 1e3 * masking["s"] / max(masking["n"], 1)
                mask_ms[mode] = min(mask_ms.get(mode, ms), ms)
                assert tokens == batch * args.new, f"{mode}: {tokens} tokens"
                best[mode] = (max(best[mode][0], whole), max(best[mode][1], decode))
        masks.background = True
        rows.append((batch, best, mask_ms))
        sample = llm.generate(prompts[:1], SamplingParams(max_tokens=24, structured=schema))[0]
        assert sample.text.startswith("[{"), sample.text
        print(f"batch {batch}: {best}, masking ms/step {mask_ms}", flush=True)
        print(f"batch {batch}: sample constrained output {sample.text!r}", flush=True)

    print()
    print(f"cpu: {isa.describe()}")
    print(f"load average (1/5/15 min) at the end: {os.getloadavg()}")
    head = f"{'batch':>5} {'metric':24} {'unconstrained':>14} {'json_schema':>12} {'ratio':>6}"
    print(f"{head} {'json_inline':>12} {'ratio':>6}")
    for batch, best, mask_ms in rows:
        for k, metric in enumerate(("output tok/s (whole run)", "output tok/s (decode)")):
            free, ours, inline = (best[m][k] for m in modes)
            print(
                f"{batch:5} {metric:24} {free:14.1f} {ours:12.1f} {ours / free:6.2f}"
                f" {inline:12.1f} {inline / free:6.2f}"
            )
        step_ms = 1e3 * batch / best["unconstrained"][1]
        print(
            f"{batch:5} {'grammar ms/step (path)':24} {'':14} {mask_ms['json_schema']:12.2f}"
            f" {mask_ms['json_schema'] / step_ms:6.1%} {mask_ms['json_inline']:12.2f}"
            f" {mask_ms['json_inline'] / step_ms:6.1%}"
            f"  of an unconstrained decode step ({step_ms:.0f} ms)"
        )
    print(
        f"(best of {args.reps}; {args.new} output tokens per request; schema: {json.dumps(SCHEMA)})"
    )


if __name__ == "__main__":
    main()
