"""What a serving benchmark sends, and when: token-id datasets and arrival processes.

Datasets (the names and semantics of `vllm bench serve --dataset-name`):

    random             every prompt random, exact lengths; an optional shared prefix in front
    prefix_repetition  num_prefixes random prefixes, n // num_prefixes prompts on each, a
                       random suffix per prompt; shuffled
    mooncake           a Mooncake-format trace (JSONL: timestamp ms, input_length,
                       output_length, hash_ids of 512-token blocks), replayed at its times

Prompts are token ids, so lengths are exact and no tokenizer is needed. Ids below 10 are
left out (special tokens in most vocabularies).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces
FIRST_ID = 10


@dataclass(frozen=True, slots=True)
class SampleRequest:
    prompt: list[int]
    output_len: int
    arrival_s: float | None = None  # a trace's own arrival, seconds from the start


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def random_requests(
    n: int, input_len: int, output_len: int, vocab: int, seed: int, prefix_len: int = 0
) -> list[SampleRequest]:
    """As vLLM's `random` with `--random-prefix-len`: the prefix comes on top of input_len."""
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len, vocab)
    return [SampleRequest(prefix + _tokens(rng, input_len, vocab), output_len) for _ in range(n)]


def prefix_repetition_requests(
    n: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int, vocab: int,
    seed: int,
) -> list[SampleRequest]:  # fmt: skip
    """As vLLM's `prefix_repetition`: num_prefixes * (n // num_prefixes) requests."""
    per_prefix = n // num_prefixes
    if per_prefix == 0:
        raise ValueError(f"num requests ({n}) must be at least num prefixes ({num_prefixes})")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prefixes):
        prefix = _tokens(rng, prefix_len, vocab)
        out += [
            SampleRequest(prefix + _tokens(rng, suffix_len, vocab), output_len)
            for _ in range(per_prefix)
        ]
    rng.shuffle(out)
    return out


def block_tokens(hash_id: int, length: int, vocab: int, seed: int = 0) -> list[int]:
    """The tokens of one trace block: a function of its hash id alone (and the seed), so
    equal ids give equal blocks in every request and every run."""
    return _tokens(random.Random(f"mooncake:{seed}:{hash_id}"), length, vocab)


def mooncake_requests(
    path: str | Path,
    vocab: int,
    block_len: int = MOONCAKE_BLOCK,
    num_requests: int | None = None,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
    skip: int = 0,
) -> list[SampleRequest]:
    """num_requests lines of a Mooncake trace after its first `skip`, scaled down for a
    small model.

    Each 512-token block becomes `block_len` tokens and every length is scaled by
    block_len / 512 (at least 1); then the caps cut prompts and outputs. Arrivals are the
    trace's timestamps from the first line taken, times `time_scale` (0.1: ten times faster).

        hash_ids   [ 7        | 8        | 9   ]        input_length 1100, block_len 16
        prompt     [ blk(7)16 | blk(8)16 | 3 of blk(9) ]  ceil(1100 * 16 / 512) = 35 tokens
    """
    scale = block_len / MOONCAKE_BLOCK
    out: list[SampleRequest] = []
    t0 = None
    with open(path) as f:
        stop = None if num_requests is None else skip + num_requests
        for lineno, line in enumerate(itertools.islice(f, skip, stop), skip + 1):
            row = json.loads(line)
            t0 = row["timestamp"] if t0 is None else t0
            n_in = max(1, math.ceil(row["input_length"] * scale))
            n_out = max(1, round(row["output_length"] * scale))
            blocks = [block_tokens(h, block_len, vocab, seed) for h in row["hash_ids"]]
            prompt = list(itertools.chain.from_iterable(blocks))
            if len(prompt) < n_in:
                raise ValueError(f"{path}:{lineno}: input_length exceeds its hash_ids blocks")
            out.append(
                SampleRequest(
                    prompt[: min(n_in, max_input_len or n_in)],
                    min(n_out, max_output_len or n_out),
                    (row["timestamp"] - t0) / 1000 * time_scale,
                )
            )
    return out


def inter_arrival_gaps(
    n: int, rate: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """Seconds between arrivals: gamma with shape = burstiness and mean 1 / rate (shape 1 is
    Poisson; below 1 burstier, above 1 more even; inf: constant). rate inf: all at once."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request is sent, seconds from the start. As vLLM does, the times are
    rescaled so the last lands at exactly n / rate: the offered load is the same whatever
    the seed, not off by the 1-2% a sum of random gaps drifts."""
    times = np.cumsum(inter_arrival_gaps(n, rate, burstiness, np.random.default_rng(seed)))
    if n and times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times.tolist()
