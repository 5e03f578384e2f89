"""One request's path through the frontend, shared by the HTTP and the gRPC ingress.

1. prepare (inputs.py): check the prompt ids against the model (vocabulary, context
   length), validate the sampling parameters, fan `n` out into one GenerateInput per choice;
2. start: prompt block hash keys (hashed here once, in the KV namespace the workers
   registered; the workers check them, not recompute them) -> route (master, or local
   fallback) -> Worker.Generate on the chosen decode/fused worker; returns once the first
   tokens arrived, so a request that cannot be served fails before any response has gone
   out;
3. stream: detokenize incrementally, apply stop strings, yield Deltas.

A worker that fails before its first token is swapped for another (excluded from the next
route); one that fails later is resumed elsewhere from prompt + tokens so far, so the
client sees one uninterrupted stream. Each such move is a migration; a sequence moves at
most `max_migrations` times (then the last worker's error is the answer), so a request that
crashes every worker it touches cannot take the whole cluster down. Only one worker stream
of a sequence is open at a time: the failed one is cancelled before the next opens, under
a new worker-side request id (`<id>-r<attempt>`), so a worker that was only slow never
generates it twice. Closing a stream cancels its worker call, which makes
the worker abort the request and free its blocks.

A request with a deadline (`timeout`) gives every call on its path (master, worker, and
through the worker the prefill worker) what is left of it as the gRPC deadline, so all hops
give up together and free what they held. Passed before the first token: a TIMEOUT error
(504); passed later: the sequence ends there with finish_reason "length" (a limit the
request set, like max_tokens; OpenAI clients know no other reason for a cut-off output).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from rtp_serve.core.block_hash import BlockHash
from rtp_serve.core.tokenizer import Tokenizer
from rtp_serve.services.common import grpc_util, tracing
from rtp_serve.services.common.convert import tenant_to_pb
from rtp_serve.services.common.pb import common_pb2, master_pb2, worker_pb2
from rtp_serve.services.frontend import metrics
from rtp_serve.services.frontend.adapters import Adapters, not_found
from rtp_serve.services.frontend.client_streams import ClientStreams
from rtp_serve.services.frontend.cold_start import WorkerWait
from rtp_serve.services.frontend.detokenizer import TextStream, TokenText
from rtp_serve.services.frontend.errors import (
    RETRYABLE,
    ErrorKind,
    FrontendError,
    from_rpc_error,
    timed_out,
)
from rtp_serve.services.frontend.inputs import GenerateInput
from rtp_serve.services.frontend.limits import Limits, max_token_chars
from rtp_serve.services.frontend.model_info import Admission, ModelInfo
from rtp_serve.services.frontend.router_client import Route, Router
from rtp_serve.services.frontend.tenant_limits import TenantLimiter
from rtp_serve.services.frontend.tenants import TenantTable

log = logging.getLogger(__name__)

DEFAULT_MAX_MIGRATIONS = 3  # worker streams per sequence: the first and up to 3 more


@dataclass(frozen=True, slots=True)
class Delta:
    """New output of one sequence: text (complete characters, stop strings cut) and the
    tokens it came from. `finish_reason` is set on the last Delta only."""

    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprob]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int  # so far, this sequence
    cached_tokens: int


class DeltaStream:
    """The Deltas of one started sequence. `aclose()` (or `contextlib.aclosing`) ends it and
    cancels its worker call, whether or not it was iterated."""

    def __init__(
        self,
        deltas: AsyncGenerator[Delta, None],
        messages: AsyncGenerator[worker_pb2.GenerateResponse, None],
    ) -> None:
        self._deltas = deltas
        self._messages = messages

    def __aiter__(self) -> AsyncGenerator[Delta, None]:
        return self._deltas

    async def aclose(self) -> None:
        await self._deltas.aclose()
        await self._messages.aclose()


class Generator:
    def __init__(
        self,
        model: ModelInfo,
        tokenizer: Tokenizer,
        router: Router,
        max_concurrent: int = 256,
        limits: Limits | None = None,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        adapters: Adapters | None = None,
        log_requests: bool = False,
        tenants: TenantTable | None = None,
        frontend_replicas: int = 1,
    ) -> None:
        """`tenants`: whom API keys serve, and their limits (default: the default tenant
        only, no limits), of which this frontend enforces 1/`frontend_replicas`."""
        if max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {max_migrations}")
        self.model = model
        self.max_migrations = max_migrations
        self.adapters = adapters or Adapters()
        self.tokenizer = tokenizer
        self.router = router
        self.admission = Admission(max_concurrent)
        self.limits = limits = limits or Limits()
        self.client_streams = ClientStreams(limits.max_streams_per_client)
        # Bounds a prompt text's tokens from its length, before tokenizing it (limits.py).
        self.max_token_chars = max_token_chars(tokenizer.id_to_token, model.vocab_size)
        self.token_text = TokenText(tokenizer, model.byte_level)
        self.metrics = metrics.frontend(model.served_name)
        self.worker_wait = WorkerWait(
            router.membership.has_route,
            limits.hold_for_workers_s,
            limits.max_waiting_for_workers,
            self.metrics.families.waiting_for_workers,
        )
        self.tenants = TenantLimiter(
            tenants or TenantTable(), self.metrics.tenant, frontend_replicas
        )
        # One log line per request at its first token: where it went, predicted and actual.
        self.log_requests = log_requests

    def _first_token(
        self,
        request_id: str,
        route: Route,
        msg: worker_pb2.GenerateResponse,
        actual: float,
    ) -> None:
        """The master's prediction of the time from routing to the first token (0s: it
        predicted none) beside what it came to (`actual`), term by term: on the request's
        span, and with --log-requests one line per request."""
        plan = route.plan or master_pb2.RoutePlan()
        split = {
            tracing.PREDICTED_TTFT: plan.predicted_ttft_s,
            tracing.PREDICTED_WAIT: plan.predicted_wait_s,
            tracing.PREDICTED_PREFILL: plan.predicted_prefill_s,
            tracing.PREDICTED_FETCH: plan.predicted_fetch_s,
            tracing.ROUTED_TTFT: actual,
            tracing.WORKER_QUEUE: msg.queue_s,
            tracing.WORKER_PREFILL: msg.prefill_s,
        }
        trace.get_current_span().set_attributes(split)
        self.metrics.worker_split(msg.queue_s, msg.prefill_s)
        if self.log_requests:
            log.info(
                "first token: request=%s worker=%s prompt_tokens=%d cached_tokens=%d "
                "predicted_s=%.4f predicted_wait_s=%.4f predicted_prefill_s=%.4f "
                "predicted_fetch_s=%.4f actual_s=%.4f queue_s=%.4f prefill_s=%.4f",
                request_id, route.decode.id or route.decode.address, msg.num_prompt_tokens,
                msg.num_cached_tokens, *split.values(),
                extra={"request_id": request_id},
            )  # fmt: skip

    def resolve_model(self, model: str) -> str:
        """The LoRA adapter a request's `model` names ("" the base model); 404 otherwise."""
        if model == self.model.served_name:
            return ""
        if self.adapters.get(model) is not None:
            return model
        served = ", ".join(
            f"`{n}`" for n in [self.model.served_name, *(a.name for a in self.adapters)]
        )
        raise FrontendError(
            ErrorKind.NOT_FOUND,
            f"The model `{model}` does not exist (this server serves {served})",
            "model",
            "model_not_found",
        )

    def block_hashes(self, prompt: list[int], lora: str) -> list[BlockHash]:
        """The prompt's keys in the KV namespace the workers registered; none while no
        worker has (nothing to route to then, unless a fixed --master without a
        nameservice: it routes without them, and the workers hash for themselves)."""
        adapter = self.adapters.get(lora) if lora else None
        if lora and adapter is None:  # unloaded since the request was accepted
            raise not_found(lora)
        kv = self.router.membership.kv_namespace()
        if kv is None:
            return []
        return kv.keys(prompt, adapter.fingerprint if adapter is not None else "")

    async def start(self, inp: GenerateInput) -> DeltaStream:
        """Route and open the worker stream; returns once the first output arrived.
        The caller must `aclose()` the stream (contextlib.aclosing)."""
        tenant = inp.tenant.metrics if inp.tenant else None
        timer = self.metrics.sequence(len(inp.prompt_token_ids), tenant)
        messages = self._worker_messages(inp, timer)
        first = await anext(messages, None)
        if first is None:
            raise FrontendError(ErrorKind.INTERNAL, "the worker sent no output")
        return DeltaStream(self._deltas(inp, first, messages, timer), messages)

    async def _worker_messages(
        self, inp: GenerateInput, timer: metrics.SequenceTimer
    ) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
        try:
            async for msg in self._attempts(inp, timer):
                yield msg
        finally:  # the master leased the request id to this frontend while it ran
            self.router.release(inp.request_id)

    async def _attempts(
        self, inp: GenerateInput, timer: metrics.SequenceTimer
    ) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
        """The worker's messages, migrating to another worker on failures."""
        produced: list[int] = []  # output tokens so far, over every attempt
        exclude: list[str] = []
        last_error: FrontendError | None = None
        for attempt in range(1 + self.max_migrations):
            if attempt:
                self.metrics.migrations.inc()
            if _passed(inp.remaining()):
                yield self._deadline_passed(inp, produced)
                return
            prompt = inp.prompt_token_ids + produced
            try:
                await self.worker_wait.until_routable(inp.remaining())
                hashes = self.block_hashes(prompt, inp.lora)
                route = await self.router.route(
                    master_pb2.RouteRequest(
                        request_id=inp.request_id,
                        packed_block_hashes=b"".join(hashes),
                        num_prompt_tokens=len(prompt),
                        session_id=inp.session_id,
                        priority=inp.priority,
                        exclude=exclude,
                        lora_name=inp.lora,
                    ),
                    inp.remaining(),
                )
            except FrontendError:
                if last_error is not None:  # what the failed worker said is the better reason
                    raise last_error from None
                raise
            trace.get_current_span().add_event(
                "route",
                {
                    "rtp.route.source": route.source,
                    "rtp.route.decode": route.decode.id or route.decode.address,
                    "rtp.route.prefill": route.prefill.id if route.prefill else "",
                    "rtp.route.attempt": attempt,
                    tracing.PREDICTED_TTFT: route.predicted_ttft_s,
                },
            )
            timer.routed(route.predicted_ttft_s)
            self.metrics.routed_by(route.source)
            request = worker_pb2.GenerateRequest(
                request_id=inp.request_id if attempt == 0 else f"{inp.request_id}-r{attempt}",
                prompt_token_ids=prompt,
                params=_continued(inp.params, len(produced)),
                priority=inp.priority,
                prefill_address=route.prefill_address,
                block_hashes=hashes,
                structured=_resumed(inp.structured, len(produced)),
                lora_name=inp.lora,
                tenant=tenant_to_pb(inp.tenant.share) if inp.tenant else None,
                remote_blocks=route.remote_blocks,
            )
            left = inp.remaining()
            if _passed(left):
                yield self._deadline_passed(inp, produced)
                return
            timer.started()
            stream = self.router.streams.generate(route.decode, request, left)
            who = f"worker {route.decode.id or route.decode.address}"
            failed_peer = ""  # the worker's peer that failed, where the worker says so
            try:
                async for msg in stream:
                    first = timer.last_token is None
                    timer.tokens(len(msg.token_ids))
                    if inp.tenant is not None:
                        inp.tenant.output(len(msg.token_ids))
                    if first and timer.routed_ttft_s is not None:
                        self._first_token(inp.request_id, route, msg, timer.routed_ttft_s)
                    produced.extend(msg.token_ids)
                    yield msg
                    if msg.finished:
                        return
                last_error = FrontendError(ErrorKind.INTERNAL, f"{who} ended the stream early")
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and inp.deadline is not None:
                    yield self._deadline_passed(inp, produced)
                    return
                last_error = from_rpc_error(exc, who)
                failed_peer = _trailing(exc, grpc_util.FAILED_PEER_KEY)
                if exc.code() not in RETRYABLE:
                    raise last_error from exc
            finally:
                await stream.aclose()  # no-op when done; else the worker aborts, frees the blocks
            log.warning(
                "request %s: %s (attempt %d, %d tokens so far)",
                inp.request_id,
                last_error.message,
                attempt + 1,
                len(produced),
                extra={"request_id": inp.request_id},
            )
            exclude.append(_failed(route, failed_peer))
        assert last_error is not None
        self.metrics.migration_limit.inc()
        log.warning(
            "request %s: giving up after %d migrations",
            inp.request_id,
            self.max_migrations,
            extra={"request_id": inp.request_id},
        )
        raise last_error

    def _deadline_passed(
        self, inp: GenerateInput, produced: list[int]
    ) -> worker_pb2.GenerateResponse:
        """The end of a sequence whose deadline passed: "length" once it has output, else
        the TIMEOUT error (raised)."""
        assert inp.timeout is not None
        if not produced:
            raise timed_out(inp.timeout, "before any output (the request was still queued)")
        log.info(
            "request %s: timeout of %g s passed after %d tokens",
            inp.request_id,
            inp.timeout,
            len(produced),
            extra={"request_id": inp.request_id},
        )
        return worker_pb2.GenerateResponse(finished=True, finish_reason="length")

    # -- 3. stream -------------------------------------------------------------------------
    async def _deltas(
        self,
        inp: GenerateInput,
        first: worker_pb2.GenerateResponse,
        messages: AsyncGenerator[worker_pb2.GenerateResponse, None],
        timer: metrics.SequenceTimer,
    ) -> AsyncGenerator[Delta, None]:
        text = TextStream(self.tokenizer, inp.stop)
        ids: list[int] = []
        logprobs: list[common_pb2.TokenLogprob] = []
        pending = ""
        completion = cached = 0
        msg: worker_pb2.GenerateResponse | None = first
        try:
            while msg is not None:
                cached = max(cached, msg.num_cached_tokens)
                new = list(msg.token_ids)
                # A stop token ends the text without appearing in it.
                stop_token = (
                    msg.HasField("stop_reason") and bool(new) and new[-1] == msg.stop_reason
                )
                for j, token in enumerate(new):
                    completion += 1
                    ids.append(token)
                    if j < len(msg.logprobs):
                        logprobs.append(msg.logprobs[j])
                    if not (stop_token and j == len(new) - 1):
                        pending += text.push([token])
                    if text.stopped:
                        break
                finish = (msg.finish_reason or "stop") if msg.finished else None
                if finish is not None and not text.stopped:
                    pending += text.finish()
                if text.stopped:
                    finish = "stop"
                if finish is not None:
                    timer.finished(finish, len(inp.prompt_token_ids), completion)
                if pending or finish is not None:
                    prompt_tokens = len(inp.prompt_token_ids)
                    yield Delta(pending, ids, logprobs, finish, prompt_tokens, completion, cached)
                    pending, ids, logprobs = "", [], []
                if finish is not None:
                    return
                msg = await anext(messages, None)
            raise FrontendError(ErrorKind.INTERNAL, "the worker stream ended unfinished")
        finally:
            timer.closed()  # counted as aborted unless it finished
            await messages.aclose()


def _failed(route: Route, failed_peer: str) -> str:
    """The member id to route around after `route` failed: its prefill worker when that is
    what failed (the decode worker said so), else the worker whose stream broke."""
    if route.prefill is not None and failed_peer == route.prefill.address:
        return route.prefill.id
    return route.decode.id


def _trailing(exc: grpc.aio.AioRpcError, key: str) -> str:
    for k, v in exc.trailing_metadata() or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return ""


def _passed(remaining: float | None) -> bool:
    return remaining is not None and remaining <= 0


def _resumed(
    structured: worker_pb2.StructuredOutput | None, done: int
) -> worker_pb2.StructuredOutput | None:
    """The grammar of a sequence resumed after `done` output tokens (now in its prompt)."""
    if structured is None or done == 0:
        return structured
    rest = worker_pb2.StructuredOutput()
    rest.CopyFrom(structured)
    rest.resume_tokens = structured.resume_tokens + done
    return rest


def _continued(params: common_pb2.SamplingParams, done: int) -> common_pb2.SamplingParams:
    """The parameters for the rest of a sequence that already has `done` output tokens."""
    if done == 0:
        return params
    rest = common_pb2.SamplingParams()
    rest.CopyFrom(params)
    rest.max_tokens = params.max_tokens - done
    rest.min_tokens = max(0, params.min_tokens - done)
    return rest
