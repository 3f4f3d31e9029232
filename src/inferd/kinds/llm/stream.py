"""One request's token stream on the front end: a single slot that merges deltas while the client is slow."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from inferd.errors import ServingError


@dataclass(frozen=True, slots=True)
class StreamChunk:
    token_ids: tuple[int, ...]
    finish_reason: str | None
    """"stop", "length", "abort" or "error" on the last chunk; None before."""


class TokenStream:
    """Written by the runtime (push/fail), read by the request handler (next). Bounded by max_tokens:
    the slot holds at most the tokens the sequence may generate."""

    __slots__ = (
        "_error", "_finish", "_ready", "_signalled", "_taken", "completion_tokens", "ended", "generated",
        "last_token_at", "prompt_tokens", "seq_id", "submitted_at", "trace", "worker_id",
    )  # fmt: skip

    def __init__(self, seq_id: str, worker_id: str, prompt_tokens: int) -> None:
        self.seq_id = seq_id
        self.worker_id = worker_id
        """The worker generating it now (another one after a failover)."""
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.submitted_at = 0.0
        self.last_token_at = 0.0
        """Front-end clock times, for time to first token and inter-token latency."""
        self.generated: list[int] = []
        """Every token delivered so far: a failover resumes the sequence after them."""
        self._taken = 0
        """How many of them `next` has handed out (the rest are pending)."""
        self._finish: str | None = None
        self._error: ServingError | None = None
        self._ready = asyncio.Event()
        self._signalled = False
        """Mirrors `_ready` being set: a push to a stream already signalled skips the event."""
        self.ended = False
        """The engine has ended the sequence (finished, aborted or failed): nothing to abort."""
        self.trace: Any = None
        """The request's span when tracing is on and its trace is sampled: it gets the stream's events."""

    def push(self, token_ids: list[int], finish_reason: str | None) -> None:
        self.generated += token_ids
        self.completion_tokens += len(token_ids)
        if finish_reason is not None:
            self._finish = finish_reason
            self.ended = True
        self._signal()

    def push_token(self, token: int) -> None:
        """`push([token], None)`, without the list: most of a stream's pushes."""
        self.generated.append(token)
        self.completion_tokens += 1
        if not self._signalled:
            self._signalled = True
            self._ready.set()

    def _signal(self) -> None:
        self._signalled = True
        self._ready.set()

    def fail(self, exc: ServingError) -> None:
        if self.ended:
            return
        self._error = exc
        self.ended = True
        self._signal()

    async def next(self) -> StreamChunk:
        """Everything that arrived since the last call (waits for something). Raises the stream's error
        once its tokens have been taken."""
        await self._ready.wait()
        generated = self.generated
        if self._taken == len(generated) and self._error is not None:
            raise self._error
        chunk = StreamChunk(tuple(generated[self._taken :]), self._finish if self._error is None else None)
        self._taken = len(generated)
        if self._finish is None and self._error is None:
            self._signalled = False
            self._ready.clear()
        return chunk
