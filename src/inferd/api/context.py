"""What route modules (openai.py, completions.py, upstream.py) may use of the front end: finding the model
version that serves a request, deadlines, the clock and the body bound. app.Api implements it; the route
modules import this protocol, never app.py, so the API package has no import cycle."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from inferd.api.asgi import HttpResponse, StreamingResponse
from inferd.api.cache_hook import CacheHook
from inferd.clock import Clock
from inferd.core.call import Call
from inferd.gateway.shadow import Shadows
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.runtime.contract import Runtime


class ApiContext(Protocol):
    clock: Clock
    max_body: int
    cache: CacheHook
    """The response cache's entry point for routes that can be cached."""
    shadows: Shadows
    """Shadow copies of sampled requests (a model's traffic.shadow), for routes that mirror them."""

    def batch_model(self, call: Call, name: str, metadata: Callable[[bytes], str | None]) -> ModelRuntime:
        """The batch-kind runtime (ModelRuntime) serving `name`, recorded on the call; 400 for other kinds.
        `metadata`: the caller's headers (or gRPC metadata) by lower-case name, for an A/B split."""
        ...

    def text_model(self, call: Call, name: str, metadata: Callable[[bytes], str | None]) -> Runtime:
        """The llm- or upstream-kind runtime serving `name`, recorded on the call; 400 for other kinds."""
        ...

    def deadline(self, rt: Runtime, call: Call, timeout_us: float | None = None) -> float | None:
        """The call's absolute deadline on `rt` (api/http.py `request_deadline`: the smaller one given,
        else the model's default)."""
        ...

    async def answer_with_fallback(
        self,
        call: Call,
        primary: Runtime,
        answer: Callable[[Runtime], Awaitable[HttpResponse | StreamingResponse]],
    ) -> HttpResponse | StreamingResponse:
        """`answer` on the primary, or on the model's fallback when the primary has no room or no worker."""
        ...
