"""A request with `n` choices: start them together, then read them as one stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from rtp_serve.services.frontend.generation import Delta, DeltaStream, Generator
from rtp_serve.services.frontend.inputs import GenerateInput


async def start_all(generator: Generator, inputs: Sequence[GenerateInput]) -> list[DeltaStream]:
    """Start every choice of a request; if one cannot start, none is left running."""
    tasks = [asyncio.create_task(generator.start(inp)) for inp in inputs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                await task.result().aclose()
        raise


async def merge(streams: Sequence[DeltaStream]) -> AsyncIterator[tuple[int, Delta]]:
    """The Deltas of several streams as they come, tagged with their stream's index.
    Closing the merged iterator closes (and so cancels) every stream."""
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: DeltaStream) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    queue.put_nowait((i, delta))
            queue.put_nowait((i, None))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
