"""Logit bias and the repetition penalties, applied to a step's logits before sampling.

vLLM's semantics (and OpenAI's formulas), in vLLM's order:

    logit_bias           l[t] += bias[t]
    repetition_penalty   t in prompt or output:  l[t] > 0 ? l[t] / p : l[t] * p   (HF's, CTRL's)
    frequency_penalty    l[t] -= f * count of t in the output
    presence_penalty     l[t] -= p * (t occurs in the output)

Greedy and random choice, top-k/p and grammar masks all see the processed logits; returned
logprobs stay those of the raw model distribution. Only rows that ask for any of it are
touched (and copied): a batch without them costs one check per row.
"""

from __future__ import annotations

import torch

from rtp_serve.engine.request import Request


def process_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits [N, V], one row per request; a new tensor if any row changed."""
    rows = [i for i, r in enumerate(requests) if r.params.processes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        _process_row(logits[i], requests[i])
    return logits


def _process_row(row: torch.Tensor, request: Request) -> None:
    params = request.params
    vocab = row.shape[-1]
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        ids_t = torch.tensor(ids, device=row.device)
        row.index_add_(0, ids_t, torch.tensor(biases, dtype=row.dtype, device=row.device))
    output = torch.tensor(request.output_token_ids, dtype=torch.long, device=row.device)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[torch.tensor(request.prompt_token_ids, dtype=torch.long, device=row.device)] = True
        seen[output] = True
        p = params.repetition_penalty
        penalized = torch.where(row > 0, row / p, row * p)
        row.copy_(torch.where(seen, penalized, row))
    if output.numel() and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
