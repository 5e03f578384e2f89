"""How every service process starts and stops: logging, uvloop, SIGTERM/SIGINT.

    setup_logging(args.log_level, args.log_format, "frontend")
    return run_service(serve(args))

`serve` is a coroutine that runs until cancelled; SIGTERM or SIGINT cancels it, so its
`finally` blocks (deregister, stop servers, drain) run before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Coroutine
from typing import Any

from rtp_serve.services.common import gc_pauses, tracing

log = logging.getLogger(__name__)

# Set on a record by `logging.LoggerAdapter`s or `extra=` to tie lines to a request.
REQUEST_FIELDS = ("request_id", "trace_id", "service")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in REQUEST_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)


def setup_logging(
    level: str = "INFO", log_format: str = "text", service: str | None = None
) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(tracing.TraceContextFilter())  # trace_id on lines logged in a span
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        prefix = f"[{service}] " if service else ""
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {prefix}%(name)s %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("asyncio", "grpc", "aiohttp.access", "nats"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_service(main: Coroutine[Any, Any, None]) -> int:
    """Run `main` on uvloop until it returns or SIGTERM/SIGINT cancels it: exit code 0;
    1 where it failed (logged)."""
    gc_pauses.watch()
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # uvloop is optional on platforms without it
        runner = asyncio.Runner()
    code = 0
    try:
        with runner:
            loop = runner.get_loop()
            task = loop.create_task(main)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, task.cancel)
            with contextlib.suppress(asyncio.CancelledError):
                runner.run(_await(task))
    except Exception:
        log.critical("failed", exc_info=True)
        code = 1
    finally:
        tracing.shutdown_tracing()  # export the last spans (bounded wait)
    log.info("stopped")
    return code


async def _await(task: asyncio.Task) -> None:
    await task
