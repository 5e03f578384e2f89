"""Speculative decoding benchmark: decode tokens/s with and without speculation.

    python bench/spec.py [--model smollm2-135m] [--threads 2] [--k 5] [--max-tokens 128]
                         [--batches 1,16] [--workloads edit,chat] [--methods ngram,draft]
                         [--draft-model DIR] [--draft-layers N]

Workloads, greedy, on the real model:
  edit  code-editing prompts whose answer repeats most of the given code; the code is the
        request's speculative_advice (RTP-LLM's sp_advice_prompt), n-gram on top
  chat  ordinary chat questions, n-gram only (whatever repeats in prompt and output)
Methods: ngram (prompt lookup and advice), draft (a draft model: --draft-model, else the
model's own first --draft-layers layers, default a quarter; it ignores advice).

Each (workload, batch) runs on the same engine with speculation off for every request
(num_speculative_tokens=0) and on, alternately, --reps times each; the median of each is
shown (one run of either on this shared machine varies by up to 10%). Decode tokens/s
counts the output tokens after each request's first over the time from the batch's first
token to its last. Outputs are
compared token for token (greedy: they must be equal). Acceptance rate and mean accepted
length are from the engine's counters over the speculative run.
Timings are wall-clock on a shared machine: compare within one run, not across runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, where bench/engine.py and its
# siblings would shadow any top-level module of the same name.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from rtp_serve.engine import SamplingParams  # noqa: E402
from rtp_serve.engine.config import EngineConfig  # noqa: E402
from rtp_serve.engine.llm_engine import LLMEngine  # noqa: E402
from rtp_serve.engine.spec_decode.stats import SpecCounts  # noqa: E402
from rtp_serve.kernels.isa import cpu_isa  # noqa: E402
from rtp_serve.models.make_model import resolve_model  # noqa: E402

CODE = [
    '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda x: x[0])
    merged = [intervals[0]]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
''',
    """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None

    def __len__(self):
        return len(self.items)
""",
    """def binary_search(values, target):
    low, high = 0, len(values) - 1
    while low <= high:
        mid = (low + high) // 2
        if values[mid] == target:
            return mid
        if values[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1
""",
    """def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if not word:
            continue
        counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])
""",
]
EDITS = [
    "Add type hints to every function in this code. Reply with the whole code only.",
    "Rename the variables to longer, clearer names. Reply with the whole code only.",
    "Add a short comment above each line that is not obvious. Reply with the code only.",
    "Convert this code to use 2-space indentation. Reply with the whole code only.",
]
CHAT = [
    "What is the capital of France, and what is it famous for?",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is to a beginner.",
    "Write a short poem about the sea.",
    "What are the main differences between Python and C?",
    "How do vaccines work?",
    "Suggest a name for a coffee shop and explain why.",
    "Why is the sky blue?",
]


@dataclass(frozen=True, slots=True)
class Run:
    tokens_per_s: float
    outputs: dict[str, list[int]]


def prompts(engine: LLMEngine, workload: str, n: int) -> list[tuple[list[int], tuple[int, ...]]]:
    """(prompt ids, advice ids) x n, cycling through the workload's texts."""
    tok = engine.tokenizer
    out = []
    for i in range(n):
        if workload == "edit":
            code = CODE[i % len(CODE)]
            text = f"{EDITS[(i // len(CODE)) % len(EDITS)]}\n\n```python\n{code}```"
            advice = tuple(tok.encode(code, add_special_tokens=False))
        else:
            text, advice = CHAT[i % len(CHAT)], ()
        chat = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        out.append((tok.encode(chat, add_special_tokens=False), advice))
    return out


def run(engine: LLMEngine, batch: list[tuple[list[int], tuple[int, ...]]], params, tag: str) -> Run:
    for i, (ids, advice) in enumerate(batch):
        p = replace(params, speculative_advice=advice)
        engine.add_request(engine.make_request(f"{tag}-{i}", ids, p))
    outputs: dict[str, list[int]] = {}
    first_at: float | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in outputs:
                outputs[out.request_id] = []
                first_at = first_at or time.perf_counter()
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    elapsed = time.perf_counter() - (first_at or time.perf_counter())
    decode_tokens = sum(len(t) - 1 for t in outputs.values())
    return Run(decode_tokens / elapsed if elapsed > 0 else 0.0, outputs)


def diff(before: SpecCounts, after: SpecCounts) -> tuple[float, float]:
    drafts = after.num_drafts - before.num_drafts
    proposed = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    rate = accepted / proposed if proposed else 0.0
    return rate, (1 + accepted / drafts if drafts else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--workloads", default="edit,chat")
    ap.add_argument("--methods", default="ngram", help="ngram, draft, or both")
    ap.add_argument("--draft-model", default=None, help="draft: a model directory or preset")
    ap.add_argument("--draft-layers", type=int, default=None, help="draft: its first N layers")
    ap.add_argument("--reps", type=int, default=3, help="off/on runs, alternated; medians shown")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = str(resolve_model(args.model))
    print(f"cpu: {cpu_isa().describe()}")
    print(f"model {args.model}, float32, threads {args.threads}, k {args.k}, greedy, "
          f"max_tokens {args.max_tokens}")  # fmt: skip
    print(f"{'method':6} {'workload':8} {'batch':>5} {'off tok/s':>10} {'on tok/s':>9} "
          f"{'speedup':>8} {'accept':>7} {'mean len':>8} {'equal':>6}")  # fmt: skip
    for method in args.methods.split(","):
        draft = {}
        if method == "draft":
            draft_dir = str(resolve_model(args.draft_model)) if args.draft_model else None
            draft = {"draft_model": draft_dir, "draft_num_layers": args.draft_layers}
        engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype="float32",
                speculative=method,
                num_speculative_tokens=args.k,
                max_num_seqs=32,
                num_threads=args.threads,
                **draft,
            )
        )
        bench_method(engine, method, args)


def bench_method(engine: LLMEngine, method: str, args: argparse.Namespace) -> None:
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for workload in args.workloads.split(","):
        for b in map(int, args.batches.split(",")):
            batch = prompts(engine, workload, b)
            run(engine, batch[:1], replace(greedy, max_tokens=4), "warm")
            before = engine.stats().spec
            offs, ons, same = [], [], True
            for rep in range(args.reps):
                off = run(engine, batch, replace(greedy, num_speculative_tokens=0), f"off{rep}")
                on = run(engine, batch, greedy, f"on{rep}")
                offs.append(off.tokens_per_s)
                ons.append(on.tokens_per_s)
                same &= all(
                    on.outputs[f"on{rep}-{i}"] == off.outputs[f"off{rep}-{i}"] for i in range(b)
                )
            assert before is not None and engine.stats().spec is not None
            rate, mean_len = diff(before, engine.stats().spec)
            off_s, on_s = statistics.median(offs), statistics.median(ons)
            print(f"{method:6} {workload:8} {b:>5} {off_s:>10.1f} {on_s:>9.1f} "
                  f"{on_s / off_s:>7.2f}x {rate:>7.2f} {mean_len:>8.2f} "
                  f"{str(same):>6}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
