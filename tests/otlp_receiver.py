"""A real OTLP/gRPC trace receiver for tests: opentelemetry-proto's TraceService served with
grpcio on a free port of 127.0.0.1, keeping every span it is sent in memory.

    with OtlpReceiver() as receiver:          # endpoint: receiver.endpoint
        ...                                   # services export with OTEL_EXPORTER_OTLP_ENDPOINT
        receiver.wait_for(lambda spans: ..., timeout=10)
        print(receiver.tree(trace_id))
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Self

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

KINDS = {
    trace_pb2.Span.SPAN_KIND_INTERNAL: "internal",
    trace_pb2.Span.SPAN_KIND_SERVER: "server",
    trace_pb2.Span.SPAN_KIND_CLIENT: "client",
    trace_pb2.Span.SPAN_KIND_PRODUCER: "producer",
    trace_pb2.Span.SPAN_KIND_CONSUMER: "consumer",
}


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root
    name: str
    service: str  # the resource's service.name
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status_error: bool = False

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self._receiver = receiver

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context):
        spans = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(
                        ReceivedSpan(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            name=s.name,
                            service=service,
                            kind=KINDS.get(s.kind, "unspecified"),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes=_attributes(s.attributes),
                            status_error=s.status.code == trace_pb2.Status.STATUS_CODE_ERROR,
                        )
                    )
        self._receiver._add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._changed:
            self._spans.extend(spans)
            self._changed.notify_all()

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._changed:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout: float) -> bool:
        """Wait until `done(all spans so far)` holds; False after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not done(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def tree(self, trace_id: str, attributes: bool = True) -> str:
        """The trace as an indented tree, children in start order; a span whose parent is not
        in the trace (the remote caller of the root) is shown at the top level."""
        spans = sorted(self.spans(trace_id), key=lambda s: s.start_ns)
        ids = {s.span_id for s in spans}
        children: dict[str, list[ReceivedSpan]] = {}
        for s in spans:
            parent = s.parent_span_id if s.parent_span_id in ids else ""
            children.setdefault(parent, []).append(s)
        lines = [f"trace {trace_id}"]

        def walk(parent: str, prefix: str) -> None:
            kids = children.get(parent, [])
            for i, s in enumerate(kids):
                last = i == len(kids) - 1
                line = f"{s.name} [{s.service}] {s.kind} {s.duration_ms:.1f} ms"
                if s.status_error:
                    line += " ERROR"
                shown = {k: v for k, v in s.attributes.items() if k.startswith(("gen_ai.", "rtp."))}
                if attributes and shown:
                    line += " " + " ".join(f"{k}={v}" for k, v in shown.items())
                lines.append(prefix + ("└─ " if last else "├─ ") + line)
                walk(s.span_id, prefix + ("   " if last else "│  "))

        walk("", "")
        return "\n".join(lines)
