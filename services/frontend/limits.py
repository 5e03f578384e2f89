"""What one request (and one client) may ask of the frontend: sizes, counts and times, each a
frontend flag. Past a limit the client gets a 400 (413 for the body) naming the field.

The model's own limits (vocabulary, context length) are checked beside these in
inputs.prepare; these are the operator's, chosen so that no single request can make the
frontend or a worker do unbounded work.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rtp_serve.services.common.env import env
from rtp_serve.services.frontend.errors import ErrorKind, FrontendError, invalid


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int = 16 << 20
    # None: the model's context length is the only bound (prompt + output must fit).
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_n: int = 8
    max_stop: int = 16  # stop strings per request
    max_stop_chars: int = 256  # characters in each stop string
    max_logprobs: int = 20  # logprobs (completions) / top_logprobs (chat)
    # Generation requests one client (client_identity) may have in flight; 0: no bound
    # but --max-concurrent.
    max_streams_per_client: int = 128
    # A connection's next request headers must arrive within this many seconds of its
    # opening or of its last response (idle keep-alive connections close then too), and a
    # request's body within this many seconds of its headers: slow clients are cut off.
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    # Scale from zero (cold_start.py): a request finding no worker waits this long for one
    # (0: refused at once), at most this many at a time.
    hold_for_workers_s: float = 0.0
    max_waiting_for_workers: int = 256

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "max_stop", "max_stop_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_logprobs < 0 or self.max_streams_per_client < 0:
            raise ValueError("max_logprobs and max_streams_per_client must be >= 0")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError("header_timeout_s and body_timeout_s must be > 0")
        if self.hold_for_workers_s < 0 or self.max_waiting_for_workers < 0:
            raise ValueError("hold_for_workers_s and max_waiting_for_workers must be >= 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Limits:
        return cls(
            max_body_bytes=args.max_body_bytes,
            max_prompt_tokens=args.max_prompt_tokens,
            max_tokens=args.max_tokens_limit,
            max_n=args.max_n,
            max_stop=args.max_stop,
            max_stop_chars=args.max_stop_chars,
            max_logprobs=args.max_logprobs,
            max_streams_per_client=args.max_streams_per_client,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            # Without a nameservice there is no membership to wait on.
            hold_for_workers_s=args.hold_for_workers_s
            if getattr(args, "nameservice", None)
            else 0.0,
            max_waiting_for_workers=args.max_waiting_for_workers,
        )

    # -- checks that need no model ---------------------------------------------------------
    def check_stop(self, stop: tuple[str, ...]) -> None:
        if len(stop) > self.max_stop:
            raise invalid(
                f"at most {self.max_stop} stop strings are allowed, got {len(stop)}", "stop"
            )
        for i, s in enumerate(stop):  # (an empty one is ignored, as OpenAI's)
            if len(s) > self.max_stop_chars:
                raise invalid(
                    f"stop[{i}] has {len(s)} characters; at most {self.max_stop_chars} are allowed",
                    "stop",
                )

    def check_logprobs(self, logprobs: int | None, param: str) -> None:
        if logprobs is not None and not 0 <= logprobs <= self.max_logprobs:
            raise invalid(f"{param} must be in [0, {self.max_logprobs}], got {logprobs}", param)

    def check_prompt_chars(self, text: str, context_len: int, max_token_chars: int, param: str):
        """Refuse, before tokenizing it, a text that cannot fit: every token covers at most
        `max_token_chars` characters, so a longer text has more tokens than allowed."""
        limit = self.prompt_limit(context_len)
        if len(text) > limit * max_token_chars:
            raise invalid(
                f"the prompt has {len(text)} characters, more than {limit} tokens can hold "
                f"(this server's limit is {limit} prompt tokens)",
                param,
            )

    def prompt_limit(self, context_len: int) -> int:
        """The most prompt tokens a request may have: shorter than the context (room for one
        output token at least), and no more than max_prompt_tokens."""
        room = context_len - 1
        return room if self.max_prompt_tokens is None else min(room, self.max_prompt_tokens)


def too_large(limit: int) -> FrontendError:
    return FrontendError(
        ErrorKind.TOO_LARGE,
        f"the request body is larger than this server's limit of {limit} bytes",
        code="request_too_large",
    )


def max_token_chars(id_to_token, vocab_size: int) -> int:
    """The most characters one token's text can have (its vocabulary string is at least as
    long: one character per byte for byte-level BPE, longer for byte fallbacks)."""
    lengths = (len(id_to_token(i) or "") for i in range(vocab_size))
    return max(max(lengths, default=1), 1)


def _optional_int(value: str | None) -> int | None:
    return int(value) if value else None


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    d = Limits()
    g = p.add_argument_group("request limits (past one: a 400 or 413 naming the field)")
    g.add_argument("--max-body-bytes", type=int,
                   default=int(env("max_body_bytes", str(d.max_body_bytes))),
                   help="largest request body (413 beyond)")  # fmt: skip
    g.add_argument("--max-prompt-tokens", type=int,
                   default=_optional_int(env("max_prompt_tokens")),
                   help="most prompt tokens (default: the context length less one)")  # fmt: skip
    g.add_argument("--max-tokens-limit", type=int,
                   default=_optional_int(env("max_tokens_limit")),
                   help="largest max_tokens a request may ask for (default: what the context "
                   "leaves after the prompt)")  # fmt: skip
    g.add_argument("--max-n", type=int, default=int(env("max_n", str(d.max_n))),
                   help="largest n")  # fmt: skip
    g.add_argument("--max-stop", type=int, default=int(env("max_stop", str(d.max_stop))),
                   help="most stop strings per request")  # fmt: skip
    g.add_argument("--max-stop-chars", type=int,
                   default=int(env("max_stop_chars", str(d.max_stop_chars))),
                   help="most characters in one stop string")  # fmt: skip
    g.add_argument("--max-logprobs", type=int,
                   default=int(env("max_logprobs", str(d.max_logprobs))),
                   help="largest logprobs / top_logprobs")  # fmt: skip
    g.add_argument("--max-streams-per-client", type=int,
                   default=int(env("max_streams_per_client", str(d.max_streams_per_client))),
                   help="generation requests one client (its address) may have in flight; "
                   "0: no bound but --max-concurrent")  # fmt: skip
    g.add_argument("--header-timeout", type=float,
                   default=float(env("header_timeout", str(d.header_timeout_s))),
                   help="seconds a connection may take to send a request's headers (from "
                   "opening, or its last response); idle connections close then too")  # fmt: skip
    g.add_argument("--body-timeout", type=float,
                   default=float(env("body_timeout", str(d.body_timeout_s))),
                   help="seconds a request may take to send its body after its headers")  # fmt: skip
    g.add_argument("--hold-for-workers-s", type=float,
                   default=float(env("hold_for_workers_s", str(d.hold_for_workers_s))),
                   help="a request that finds no worker waits this long for one to start (scale "
                   "from zero; bounded by its deadline); 0: 503 at once")  # fmt: skip
    g.add_argument("--max-waiting-for-workers", type=int,
                   default=int(env("max_waiting_for_workers", str(d.max_waiting_for_workers))),
                   help="requests held for a worker at once; past it: 503 at once")  # fmt: skip
