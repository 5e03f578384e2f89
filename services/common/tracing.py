"""OpenTelemetry for every service: tracer setup, and W3C trace context across every hop.

    HTTP  `traceparent` header  -> frontend: http_server_span() (the request's root span)
    gRPC  metadata              client interceptor (grpc_util.channel) makes a CLIENT span
                                and injects it; server interceptor (grpc_util.create_server)
                                makes the SERVER span its handler runs in
    NATS  message headers       Bus.publish injects; subscribe handlers run in the context

Tracing is on when OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is
set; every other OTEL_* variable (headers, timeout, sampler, OTEL_BSP_*, ...) is read by
the SDK as usual. When off, no SDK is imported, `tracer` is the API's no-op, and channels
and servers get no interceptors: tracing costs nothing.

Only RPCs made inside a request's trace are traced: a call made with no current span
(heartbeats, health checks, membership watches) gets no span and starts no trace, and a
server span is made only for calls that carry a `traceparent`, or that enter the system
(ROOT_SERVICES).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

tracer = trace.get_tracer("rtp-serve")  # a proxy: real once setup_tracing installs the SDK

# gRPC services whose calls start a trace even without an incoming `traceparent`.
ROOT_SERVICES = frozenset({"rtp.v1.Frontend"})
SHUTDOWN_TIMEOUT_S = 5.0  # flushing spans never holds a stopping service longer than this
TRACEPARENT = "traceparent"

# Span attribute names (vLLM's gen_ai.* for the request span, rtp.* for our own).
REQUEST_ID = "gen_ai.request.id"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_N = "gen_ai.request.n"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
CACHED_TOKENS = "gen_ai.usage.cached_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
E2E_LATENCY = "gen_ai.latency.e2e"
# The master's predicted time from routing to the first token, and what it came to.
PREDICTED_TTFT = "rtp.route.predicted_ttft_s"
ROUTED_TTFT = "rtp.route.actual_ttft_s"
# The prediction's terms (they add up to it), and the worker's own split of what happened:
# its queue (the prefix fetch included) and its prefill; the rest of the actual is the hops.
PREDICTED_WAIT = "rtp.route.predicted_wait_s"
PREDICTED_PREFILL = "rtp.route.predicted_prefill_s"
PREDICTED_FETCH = "rtp.route.predicted_fetch_s"
WORKER_QUEUE = "rtp.worker.queue_s"
WORKER_PREFILL = "rtp.worker.prefill_s"
TENANT = "rtp.tenant"  # whom the request is served for (services/frontend/tenants.py)

_provider: Any = None  # the SDK TracerProvider, once installed
_pending: set[asyncio.Task[None]] = set()  # client spans waiting for their call's status


def exporting() -> bool:
    """Whether the environment asks for spans to be exported over OTLP."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def enabled() -> bool:
    return _provider is not None


def default_instance_id() -> str:
    """Unique per process: the host (a pod's or container's name) and the pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


def setup_tracing(service_name: str, instance_id: str) -> bool:
    """Install the SDK (resource `service.name`, `service.instance.id`; batched OTLP/gRPC
    export) if `exporting()`; otherwise install nothing. True if tracing is on."""
    global _provider
    if _provider is not None:
        return True
    if not exporting():
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create(
        {SERVICE_NAME: service_name, SERVICE_INSTANCE_ID: instance_id, "service.namespace": "rtp"}
    )
    # shutdown_on_exit=False: shutdown_tracing() flushes, with a bound (see there).
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    log.info("tracing on: %s (%s) exports to %s", service_name, instance_id, endpoint)
    return True


def shutdown_tracing(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Export the spans still buffered and stop the exporter. An unreachable collector
    would make the SDK retry for its full export timeout, so this waits `timeout_s` at most."""
    global _provider
    provider, _provider = _provider, None
    if provider is None:
        return
    worker = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        log.warning("tracing: spans not flushed within %.1fs; dropping them", timeout_s)


# -- logs ----------------------------------------------------------------------------------
class TraceContextFilter(logging.Filter):
    """Sets `trace_id` (32 hex digits) on records logged inside a span, so every line
    about a request names its trace (lifecycle.JsonFormatter prints it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "trace_id", None) is None:
            ctx = trace.get_current_span().get_span_context()
            if ctx.is_valid:
                record.trace_id = trace.format_trace_id(ctx.trace_id)
        return True


def current_trace_id() -> str | None:
    ctx = trace.get_current_span().get_span_context()
    return trace.format_trace_id(ctx.trace_id) if ctx.is_valid else None


def seconds_since_start(span: Span) -> float | None:
    """How long `span` has been open (None for a non-recording span)."""
    start = getattr(span, "start_time", None)
    if start is None or not span.is_recording():
        return None
    return (time.time_ns() - start) / 1e9


# -- HTTP ----------------------------------------------------------------------------------
@contextlib.contextmanager
def http_server_span(
    name: str, headers: Mapping[str, str], attributes: dict[str, Any] | None = None
) -> Iterator[Span]:
    """A SERVER span, current for the body, child of the caller's `traceparent` if any."""
    parent = propagate.extract(headers) if TRACEPARENT in headers else None
    with tracer.start_as_current_span(
        name, context=parent, kind=SpanKind.SERVER, attributes=attributes
    ) as span:
        yield span


# -- NATS ----------------------------------------------------------------------------------
def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """`headers` plus the current trace context (unchanged outside a trace)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return headers
    out = dict(headers or {})
    propagate.inject(out)
    return out


@contextlib.contextmanager
def extracted(headers: Mapping[str, str] | None) -> Iterator[None]:
    """Run the body in the trace context that `headers` carry (if they carry one)."""
    if not headers or TRACEPARENT not in headers:
        yield
        return
    token = otel_context.attach(propagate.extract(headers))
    try:
        yield
    finally:
        otel_context.detach(token)


# -- gRPC ----------------------------------------------------------------------------------
def client_interceptors(address: str) -> list[grpc.aio.ClientInterceptor]:
    """For grpc_util.channel: none while tracing is off."""
    if not enabled():
        return []
    return [kind(address) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """For grpc_util.create_server: none while tracing is off."""
    return [_ServerInterceptor()] if enabled() else []


def _rpc_attributes(method: str) -> tuple[str, dict[str, Any]]:
    """("rtp.v1.Master/Route", rpc.* attributes) for "/rtp.v1.Master/Route"."""
    name = method.lstrip("/")
    service, _, rpc_method = name.partition("/")
    return name, {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc_method}


class _ClientTracing:
    """A CLIENT span per call made inside a trace, lasting until the call is done, and its
    context in the call's metadata. Runs in a task that copied the caller's context."""

    def __init__(self, address: str) -> None:
        self._peer = _peer(address)

    async def _intercept(self, continuation, details, request):
        if not trace.get_current_span().get_span_context().is_valid:
            return await continuation(details, request)
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        name, attributes = _rpc_attributes(method)
        span = tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes | self._peer)
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        propagate.inject(metadata, context=trace.set_span_in_context(span))
        try:
            call = await continuation(details._replace(metadata=metadata), request)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            span.end()
            raise
        call.add_done_callback(lambda done: _end_when_known(span, done))
        return call


# grpc.aio files an interceptor under the first of the four kinds it is an instance of, so
# each kind needs an object of its own.
class _UnaryUnary(_ClientTracing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStream(_ClientTracing, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


class _StreamUnary(_ClientTracing, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await self._intercept(continuation, client_call_details, request_iterator)


class _StreamStream(_ClientTracing, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await self._intercept(continuation, client_call_details, request_iterator)


def _peer(address: str) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    peer: dict[str, Any] = {"server.address": host or address}
    if port.isdigit():
        peer["server.port"] = int(port)
    return peer


# -- requests sharing one call (services/worker/streams.py) ----------------------------------
def client_span(method: str, address: str, carrier: dict[str, str]) -> Span | None:
    """A CLIENT span for one request sent on a call that many share, as the client
    interceptor makes one per call, its context put in `carrier` (the request's own
    metadata): None outside a trace."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    name, attributes = _rpc_attributes(method)
    span = tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes | _peer(address))
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span


def end_client_span(span: Span, code: grpc.StatusCode, details: str) -> None:
    """End a `client_span` with the request's status."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))
    span.end()


def traced_stream(behavior, method: str, carrier: Mapping[str, str]):
    """`behavior`, a server-streaming handler, inside a SERVER span child of the context in
    `carrier`, as the server interceptor runs a call's: for one request of a call that
    many share. `behavior` itself where the carrier holds no trace."""
    if TRACEPARENT not in carrier:
        return behavior
    name, attributes = _rpc_attributes(f"/{method}")
    return _traced_stream(behavior, name, propagate.extract(carrier), attributes)


def _end_when_known(span: Span, call: grpc.aio.Call) -> None:
    # A done callback cannot await; the status of a finished call is there at once.
    task = asyncio.get_running_loop().create_task(_end_with_status(span, call))
    _pending.add(task)
    task.add_done_callback(_pending.discard)


async def _end_with_status(span: Span, call: grpc.aio.Call) -> None:
    try:
        code = await call.code()
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {await call.details()}"))
    finally:
        span.end()


class _ServerInterceptor(grpc.aio.ServerInterceptor):
    """Runs each traced handler inside a SERVER span, child of the caller's context."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        carrier = {k: v for k, v in handler_call_details.invocation_metadata or ()}
        name, attributes = _rpc_attributes(handler_call_details.method)
        if TRACEPARENT not in carrier and attributes["rpc.service"] not in ROOT_SERVICES:
            return handler
        parent = propagate.extract(carrier)
        field = _HANDLER_FIELDS[(handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, field)
        if inspect.isasyncgenfunction(behavior):
            wrapped = _traced_stream(behavior, name, parent, attributes)
        elif inspect.iscoroutinefunction(behavior):
            wrapped = _traced_call(behavior, name, parent, attributes)
        else:  # a sync handler runs in a thread pool: leave it alone
            return handler
        return handler._replace(**{field: wrapped})


_HANDLER_FIELDS = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


def _start_server_span(name: str, parent, attributes: dict[str, Any]) -> Span:
    return tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)


def _end_server_span(span: Span, context, error: BaseException | None) -> None:
    code = context.code() if hasattr(context, "code") else None
    if isinstance(error, asyncio.CancelledError):
        code = grpc.StatusCode.CANCELLED
    elif error is not None and code in (None, grpc.StatusCode.OK):
        code = grpc.StatusCode.UNKNOWN
        span.record_exception(error)
    if isinstance(code, grpc.StatusCode):
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            details = context.details() if hasattr(context, "details") else ""
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}"))
    span.end()


def _traced_call(behavior, name: str, parent, attributes: dict[str, Any]):
    async def call(request, context):
        span = _start_server_span(name, parent, attributes)
        error: BaseException | None = None
        try:
            with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                return await behavior(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            _end_server_span(span, context, error)

    return call


def _traced_stream(behavior, name: str, parent, attributes: dict[str, Any]):
    # The span is made current for each step of the handler only, never across a yield:
    # whoever resumes or finalizes a generator may run it in another task's context.
    async def stream(request, context):
        span = _start_server_span(name, parent, attributes)
        span_context = trace.set_span_in_context(span, parent)
        responses = behavior(request, context)
        error: BaseException | None = None
        try:
            while True:
                token = otel_context.attach(span_context)
                try:
                    item = await anext(responses)
                except StopAsyncIteration:
                    return
                finally:
                    otel_context.detach(token)
                yield item
        except BaseException as exc:
            error = exc
            raise
        finally:
            token = otel_context.attach(span_context)
            try:
                await responses.aclose()  # its own finally blocks run inside the span
            finally:
                otel_context.detach(token)
                closed = isinstance(error, GeneratorExit)  # the caller stopped reading
                _end_server_span(span, context, None if closed else error)

    return stream
