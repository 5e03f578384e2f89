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

The step's choice reaches the host in one device-to-host copy for all rows (argmaxes and
the random rows' probabilities together), and its logprobs, where any row asks, in one
more: never a copy per row, each of which would wait for the device on a GPU.
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
        tokens = self._choose(masked, requests)
        logprobs = _logprobs(raw, tokens, requests)
        return [SampledToken(t, lp) for t, lp in zip(tokens, logprobs, strict=True)]

    def _choose(self, masked: torch.Tensor, requests: list[Request | DraftRow]) -> list[int]:
        """Every row's token: argmax, or a draw from its probabilities on the CPU."""
        n, vocab = masked.shape
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        probs = [self._probs_row(masked[i], requests[i]) for i in random_rows]
        # float64 holds the token ids exactly and every float32/bf16 probability losslessly.
        parts = [masked.argmax(dim=-1).double(), *(p.double() for p in probs)]
        host = to_host(torch.cat(parts))
        tokens = [int(t) for t in host[:n].long().tolist()]
        for j, i in enumerate(random_rows):
            row = host[n + j * vocab : n + (j + 1) * vocab].to(probs[j].dtype)
            request = requests[i]
            assert request.sample_seed is not None
            tokens[i] = draw(row, request.sample_seed, len(request.token_ids))
        return tokens

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

    def _probs_row(self, row: torch.Tensor, request: Request) -> torch.Tensor:
        """The row's sampling distribution (temperature, top-k, top-p), on its device."""
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
        return x.softmax(-1)  # the noise is drawn on the CPU (_choose)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """The sampler's one way to the host: a copy that waits for the device."""
    return t.cpu()


def _logprobs(
    raw: torch.Tensor, tokens: list[int], requests: list[Request | DraftRow]
) -> list[TokenLogprobs | None]:
    """Logprobs of the rows that ask for them (chosen token and top n of the raw model
    distribution), computed on the device and read back in one copy."""
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(requests)
    if not rows:
        return out
    parts = []
    for i in rows:
        lp = raw[i].log_softmax(-1)
        parts.append(lp[tokens[i] : tokens[i] + 1])
        n = requests[i].params.logprobs
        if n:
            values, ids = torch.topk(lp, n)
            parts += [values, ids]
    host = iter(to_host(torch.cat([p.double() for p in parts])).tolist())
    for i in rows:
        chosen = next(host)
        n = requests[i].params.logprobs or 0
        values = [next(host) for _ in range(n)]
        ids = [int(next(host)) for _ in range(n)]
        top = dict(zip(ids, values, strict=True))
        out[i] = TokenLogprobs(token_id=tokens[i], logprob=chosen, top=top)
    return out
