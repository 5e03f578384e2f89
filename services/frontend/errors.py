"""Why a request is refused, in one vocabulary that both ingresses map to their own status:
HTTP status + OpenAI error body, or a gRPC status code."""

from __future__ import annotations

import enum

import grpc


class ErrorKind(enum.Enum):
    # (HTTP status, OpenAI error type, gRPC status)
    INVALID = (400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT)
    UNAUTHORIZED = (401, "invalid_request_error", grpc.StatusCode.UNAUTHENTICATED)
    # A valid key that may not do this: a priority above its allowance, an admin endpoint.
    FORBIDDEN = (403, "permission_error", grpc.StatusCode.PERMISSION_DENIED)
    NOT_FOUND = (404, "invalid_request_error", grpc.StatusCode.NOT_FOUND)
    # At odds with the server's state: an adapter in use, a request id (X-Request-Id) that a
    # request still in flight carries.
    CONFLICT = (409, "invalid_request_error", grpc.StatusCode.FAILED_PRECONDITION)
    TOO_LARGE = (413, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT)
    # The client sent its request too slowly (a body past --body-timeout): 408 blames it.
    SLOW_CLIENT = (408, "invalid_request_error", grpc.StatusCode.DEADLINE_EXCEEDED)
    OVERLOADED = (429, "rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED)
    INTERNAL = (500, "server_error", grpc.StatusCode.INTERNAL)
    UNAVAILABLE = (503, "service_unavailable_error", grpc.StatusCode.UNAVAILABLE)
    # The request's own deadline (`timeout`) passed before any output: the server, a gateway
    # to the workers, got no answer in time (504). Not 408, which blames the client for
    # sending its request too slowly.
    TIMEOUT = (504, "timeout_error", grpc.StatusCode.DEADLINE_EXCEEDED)

    @property
    def http_status(self) -> int:
        return self.value[0]

    @property
    def error_type(self) -> str:
        return self.value[1]

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.value[2]


class FrontendError(Exception):
    """A refusal with a message meant for the client."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after: int | None = None  # a 429's Retry-After, seconds (None: the default)

    def body(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None) -> FrontendError:
    return FrontendError(ErrorKind.INVALID, message, param)


def timed_out(timeout: float, where: str) -> FrontendError:
    return FrontendError(
        ErrorKind.TIMEOUT,
        f"the request's timeout of {timeout:g} s passed {where}",
        "timeout",
        "request_timeout",
    )


# Worker/master statuses worth another worker: it is gone, full, or gave up the request.
RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
)


def from_rpc_error(exc: grpc.aio.AioRpcError, who: str) -> FrontendError:
    """The client-facing error for a failed call to `who` (a worker or the master)."""
    code = exc.code()
    message = f"{who}: {exc.details() or code.name}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return FrontendError(ErrorKind.INVALID, message)
    if code == grpc.StatusCode.NOT_FOUND:  # a LoRA adapter the worker does not serve
        return FrontendError(ErrorKind.NOT_FOUND, message, "model", "model_not_found")
    if code == grpc.StatusCode.ALREADY_EXISTS:  # the id is in flight through another frontend
        return FrontendError(ErrorKind.CONFLICT, message, code="duplicate_request_id")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return FrontendError(ErrorKind.OVERLOADED, message, code="rate_limit_exceeded")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return FrontendError(ErrorKind.UNAVAILABLE, message, code="service_unavailable")
    return FrontendError(ErrorKind.INTERNAL, message)
