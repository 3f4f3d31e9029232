"""Token streams to text for the OpenAI text routes: one choice's text pieces cut at the first stop
string, several choices interleaved as they arrive, or every choice collected whole.

Stop strings are matched on the front end, on the generated text; reaching one aborts the sequence.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

from inferd.core.disconnect import Departure, until_disconnect
from inferd.errors import ModelError, WorkerUnavailable
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.llm.stream import TokenStream

T = TypeVar("T")


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


async def collect(
    rt: LLMRuntime, streams: list[TokenStream], stops: list[str], departure: Departure
) -> list[tuple[str, str]]:
    """Every choice's whole completion, for a non-streaming request; a disconnect aborts the sequences
    (499). A stream's error (DeadlineExceeded, WorkerDied, ...) is raised once all have ended."""

    async def gather(stream: TokenStream) -> tuple[str, str]:
        parts, finish = [], "length"
        async for text, reason in generate(rt, stream, stops):
            parts.append(text)
            finish = reason or finish
        return "".join(parts), finish

    gone = True  # until every choice has ended: a disconnect (499) or a cancellation ended the wait
    try:
        work = asyncio.gather(*(gather(s) for s in streams), return_exceptions=True)
        results = await until_disconnect(departure, work)
        gone = False
    finally:
        for stream in streams:
            rt.abort(stream, client_gone=gone)
    for r in results:  # every choice was awaited, so no failure goes unretrieved; the first one answers
        if isinstance(r, BaseException):
            raise r
    return results


async def generate(
    rt: LLMRuntime, stream: TokenStream, stops: list[str]
) -> AsyncIterator[tuple[str, str | None]]:
    """(text, finish_reason) pieces of one sequence's output, cut at the first stop string."""
    checker = StopChecker(stops)
    text_of = rt.tokenizer.detokenizer()
    while True:
        chunk = await stream.next()
        text = text_of.feed(chunk.token_ids) if chunk.token_ids else ""
        if chunk.finish_reason is not None:
            text += text_of.flush()
        emit, stopped = checker.feed(text)
        if stopped:
            rt.abort(stream, client_gone=False)
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
