"""A request's token streams as text: one choice's (text, finish_reason) pieces, detokenized and cut at
the first stop string, and several choices interleaved as they arrive (kinds/llm/service.py reads them).

Stop strings are matched on the front end, on the generated text; reaching one aborts the sequence.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from inferd.errors import ModelError, WorkerUnavailable
from inferd.kinds.llm.model import Detokenizer
from inferd.kinds.llm.stream import TokenStream

T = TypeVar("T")
Abort = Callable[[TokenStream, bool], None]
"""Ends a sequence in its engine (LLMRuntime.abort): the stream, and whether its client left."""


async def interleave(iters: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index, item) from several async iterators as items arrive; an iterator's error ends it all.
    One iterator (a request with n = 1, nearly all of them) is read directly: a task and a wait per item
    cost the front end ~10 us per streamed token."""
    if len(iters) == 1:
        try:
            async for item in iters[0]:
                yield 0, item
        finally:
            await _close(iters)
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=pending.__getitem__):
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iters[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await _close(iters)


async def _close(iters: list[AsyncIterator[T]]) -> None:
    """Close the generators now (their `finally` runs here, not when the loop collects them)."""
    for it in iters:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


async def pieces(
    stream: TokenStream, text_of: Detokenizer, stops: list[str], abort: Abort
) -> AsyncIterator[tuple[str, str | None]]:
    """(text, finish_reason) pieces of one sequence's output, cut at the first stop string (which aborts
    the sequence: `abort(stream, False)`)."""
    checker = StopChecker(stops)
    while True:
        chunk = await stream.next()
        text = text_of.feed(chunk.token_ids) if chunk.token_ids else ""
        if chunk.finish_reason is not None:
            text += text_of.flush()
        emit, stopped = checker.feed(text)
        if stopped:
            abort(stream, False)
            yield emit, "stop"
            return
        if chunk.finish_reason is not None:
            yield emit + checker.rest(), _finish_reason(chunk.finish_reason)
            return
        if emit:
            yield emit, None


def _finish_reason(reason: str) -> str:
    if reason in ("stop", "length"):
        return reason
    if reason == "abort":
        raise WorkerUnavailable("the engine aborted the sequence (shutting down or preempted away)")
    raise ModelError("the model failed while generating this sequence")


class StopChecker:
    """Finds the first stop string in text that arrives in pieces; holds back a possible partial match."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was reached)."""
        self.text += piece
        hits = [i for i in (self.text.find(s, self.emitted) for s in self.stops) if i >= 0]
        if hits:
            out = self.text[self.emitted : min(hits)]
            self.emitted = len(self.text)
            return out, True
        safe = max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : safe]
        self.emitted = safe
        return out, False

    def rest(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
