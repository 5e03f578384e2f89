"""What a cancelled gRPC call costs the client's memory: grpcio's own idiom against ours.

    python bench/grpc_cancel.py                 # 20,000 calls per case
    python bench/grpc_cancel.py --calls 5000 --cases stream-set-up

A frontend cancels a worker call whenever its client gives up or disconnects. With grpcio's
asyncio API (1.82-1.85) a coroutine cancelled while it waits inside grpc leaks native memory,
which no garbage collection returns. Each case runs in its own client process against a
server process: `--calls` calls after as many to warm up, `--concurrency` at a time, each
given up by the client after `--give-up-ms` (asyncio.wait_for). It prints the client's
resident memory before and after (after a full collection) and the growth per 1,000 calls:

- `grpc`: `async for msg in call` and `call.cancel()` in `finally`, unary calls awaited
  directly, the server sending its headers with its first message (grpcio's examples);
- `ours`: `rtp_serve.services.common.grpc_util.responses/cancel/unary`, the server sending its headers
  when it takes the call (`rtp_serve.services.worker.drain`).

Cases: `stream-whole` (nobody gives up: what reading costs, in the client's CPU time per
call of 16 messages), `stream-set-up` (the server answers after 40 ms, so the client gives
up before the call is set up), `stream-mid` (the client gives up mid-stream), `unary` (the
client gives up while the server takes 40 ms to answer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import multiprocessing as mp
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent  # run as a script: the repository root first
sys.path = [str(_ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != _ROOT / "bench"]

import grpc  # noqa: E402

from rtp_serve.kernels.isa import cpu_isa  # noqa: E402
from rtp_serve.services.common import grpc_util  # noqa: E402

CASES = ("stream-whole", "stream-set-up", "stream-mid", "unary")
STYLES = ("grpc", "ours")
MESSAGES = 16


def _same(b: bytes) -> bytes:
    return b


async def _serve(port: mp.Queue) -> None:
    async def stream(request: bytes, context: grpc.aio.ServicerContext):
        early, first_delay = request[0] == ord("e"), request[1] == ord("s")
        if early:
            await context.send_initial_metadata(())
        if first_delay:
            await asyncio.sleep(0.04)
        for _ in range(MESSAGES):
            await asyncio.sleep(0.003)
            yield b"t" * 30

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(0.04)
        return b"r" * 40

    handlers = grpc.method_handlers_generic_handler(
        "bench.Cancel",
        {
            "Stream": grpc.unary_stream_rpc_method_handler(stream, _same, _same),
            "Unary": grpc.unary_unary_rpc_method_handler(unary, _same, _same),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handlers,))
    port.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


def _server(port: mp.Queue) -> None:
    asyncio.run(_serve(port))


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _one(ch: grpc.aio.Channel, case: str, style: str) -> None:
    if case == "unary":
        call = ch.unary_unary("/bench.Cancel/Unary", _same, _same)(b"u", timeout=10)
        await (grpc_util.unary(call) if style == "ours" else call)
        return
    request = (b"e" if style == "ours" else b"l") + (b"m" if case == "stream-mid" else b"s")
    call = ch.unary_stream("/bench.Cancel/Stream", _same, _same)(request, timeout=10)
    if style == "ours":
        try:
            async for _ in grpc_util.responses(call):
                pass
        finally:
            grpc_util.cancel(call)
    else:
        try:
            async for _ in call:
                pass
        finally:
            call.cancel()


async def _client(address: str, case: str, style: str, calls: int, concurrency: int, give_up):
    ch = grpc.aio.insecure_channel(address)
    started = 0

    async def loop() -> None:
        nonlocal started
        while started < calls:
            started += 1
            with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError):
                await asyncio.wait_for(_one(ch, case, style), give_up)

    await asyncio.gather(*(loop() for _ in range(concurrency)))  # warm-up: the same again
    started, before = 0, (gc.collect(), _rss_mib())[1]
    cpu = time.process_time()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    cpu = time.process_time() - cpu
    await asyncio.sleep(0.5)  # calls cancelled in the background end
    gc.collect()
    await ch.close()
    return before, _rss_mib(), cpu


def _run_case(address: str, args: argparse.Namespace, case: str, style: str, out: mp.Queue):
    give_up = {"stream-whole": 10_000, "stream-set-up": 20, "stream-mid": 30, "unary": 20}[
        case
    ] / 1000
    give_up = args.give_up_ms / 1000 if args.give_up_ms else give_up
    out.put(asyncio.run(_client(address, case, style, args.calls, args.concurrency, give_up)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--calls", type=int, default=20_000, help="calls per case (after as many to warm up)"
    )
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument(
        "--give-up-ms",
        type=float,
        default=0.0,
        help="default: 20 (set-up, unary), 30 (mid), never (whole)",
    )
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    ports: mp.Queue = ctx.Queue()
    server = ctx.Process(target=_server, args=(ports,), daemon=True)
    server.start()
    address = f"127.0.0.1:{ports.get()}"
    print(
        f"cpu: {cpu_isa().describe()}; grpcio {grpc.__version__}; {args.calls} calls per case, "
        f"{args.concurrency} at a time"
    )
    print(
        f"{'case':<14} {'style':<5} {'RSS before':>10} {'after':>8} {'KiB / 1000 calls':>17}"
        f" {'CPU us / call':>14}"
    )
    for case in args.cases:
        for style in STYLES:
            out: mp.Queue = ctx.Queue()
            client = ctx.Process(target=_run_case, args=(address, args, case, style, out))
            client.start()
            before, after, cpu = out.get()
            client.join()
            per = (after - before) * 1024 / args.calls * 1000
            print(
                f"{case:<14} {style:<5} {before:>9.1f}M {after:>7.1f}M {per:>17.1f}"
                f" {cpu / args.calls * 1e6:>14.0f}"
            )
    server.terminate()


if __name__ == "__main__":
    main()
