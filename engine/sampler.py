"""Turn a step's logits into tokens: greedy, temperature, top-k, top-p, seeds, logprobs,
structured outputs.

Greedy rows are decided by one batched argmax. A random row's draw is a function of its
request's seed and the token's position (engine/sampling_noise.py), so a seeded request
samples the same tokens whatever else shares its batch, and with or without speculative
decoding (a row may be a draft position, engine/spec_decode/rejection.py). Logprobs are of the raw model distribution (before temperature/top-k/p
and grammars).

A row with a grammar (`Request.guide`, or a draft row of such a request) may only take the
tokens its grammar allows next: the runner starts the masks of all such rows before the
forward pass (engine/grammar_masks.py, on a worker thread) and every other token's logit
gets -inf here, before greedy or random choice. Unconstrained rows in the same batch are
not touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rtp_serve.core.outputs import SampledToken, TokenLogprobs
from rtp_serve.engine.grammar_masks import PendingMasks, entries_of
from rtp_serve.engine.grammar_masks import compute as compute_masks
from rtp_serve.engine.logits_processors import process_logits
from rtp_serve.engine.request import Request
from rtp_serve.engine.sampling_noise import draw

if TYPE_CHECKING:
    from rtp_serve.engine.spec_decode.rejection import DraftRow


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = list(eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request | DraftRow],
        masks: PendingMasks | None = None,
    ) -> list[SampledToken]:
        """logits [N, V] float32, one row per request that samples this step (or per row of
        its verification, engine/spec_decode/rejection.py). `masks`: the grammar masks of these
        rows, started before the forward pass (computed here if not given)."""
        raw = logits
        processed = process_logits(logits, requests)  # bias and penalties
        early = self._mask_early_stops(processed, requests)
        masked = self._mask_guided(early, requests, masks)
        greedy = masked.argmax(dim=-1).tolist()
        out = []
        for i, request in enumerate(requests):
            params = request.params
            token = greedy[i] if params.greedy else self._sample_row(masked[i], request)
            lp = None
            if params.logprobs is not None:
                lp = _logprobs(raw[i], token, params.logprobs)
            out.append(SampledToken(token, lp))
        return out

    def _mask_early_stops(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Forbid EOS and stop tokens until a request has produced min_tokens."""
        rows = [
            i
            for i, r in enumerate(requests)
            if r.params.min_tokens and r.num_output_tokens < r.params.min_tokens
        ]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            params = requests[i].params
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
            if banned:
                logits[i, banned] = float("-inf")
        return logits

    def _mask_guided(
        self, logits: torch.Tensor, requests: list[Request], masks: PendingMasks | None
    ) -> torch.Tensor:
        """Forbid every token a row's grammar does not allow next."""
        if masks is None:
            entries = entries_of(requests)
            if not entries:
                return logits
            masks = PendingMasks(entries, compute_masks(entries, logits.shape[-1]))
        rows, biases = masks.rows, masks.biases().to(logits.device, logits.dtype)
        if len(rows) == logits.shape[0]:  # every row constrained (rows are in order)
            return logits + biases
        return logits.index_add(0, torch.tensor(rows, device=logits.device), biases)

    def _sample_row(self, row: torch.Tensor, request: Request) -> int:
        params = request.params
        x = row / params.temperature
        if params.top_k > 0 and params.top_k < x.shape[-1]:
            kth = torch.topk(x, params.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            probs = sorted_x.softmax(-1)
            # Drop a token when the tokens ranked above it already reach top_p.
            drop = (probs.cumsum(-1) - probs) >= params.top_p
            drop[0] = False
            x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
        probs = x.softmax(-1).cpu()  # the noise is drawn on the CPU
        assert request.sample_seed is not None
        return draw(probs, request.sample_seed, len(request.token_ids))


def _logprobs(row: torch.Tensor, token: int, n: int) -> TokenLogprobs:
    lp = row.log_softmax(-1)
    top: dict[int, float] = {}
    if n:
        values, ids = torch.topk(lp, n)
        top = dict(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token_id=token, logprob=float(lp[token]), top=top)
