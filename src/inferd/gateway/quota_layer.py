"""The `Quotas` layer: applies each tenant's limits (gateway/quotas.py, through gateway/quota_store.py)
to its calls, after `Auth` has named the tenant.

A call of a limited tenant takes one admission: on most routes when it enters the layer (a request and a
concurrency slot); on the token routes (/v1/completions, /v1/chat/completions) and an LLM's gRPC
requests (`Call.reserves_tokens`) when the handler knows what it will generate, so the tokens limit
reserves prompt + n x max_tokens (`reserve_tokens`). The unused part is refunded and the concurrency
slot freed when the answer ends (a stream: when it closes).
A refusal is a 429 with an honest Retry-After; every response of a limited tenant carries OpenAI's
`x-ratelimit-*` headers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from inferd.core.call import Call, Handler, Reply
from inferd.core.tenant import Tenant
from inferd.errors import BadRequest, Overloaded, ServingError
from inferd.gateway.quota_store import TenantQuotas, limited
from inferd.gateway.quotas import QuotaDecision

TOKEN_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Routes (`Call.route`) whose admission waits for the handler's token count (`reserve_tokens`)."""
CONCURRENCY_RETRY_S = 1.0
"""Retry-After of a refusal by max_concurrency alone: a slot frees when a request ends, which the
policy cannot foresee (its own bound is the lease expiry, minutes away)."""


def header_pairs(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in headers.items()]


class QuotaExceeded(Overloaded):
    """A tenant over one of its limits (429), with OpenAI's x-ratelimit-* headers."""

    def __init__(self, message: str, retry_after_s: float, headers: dict[str, str]) -> None:
        super().__init__(message, retry_after_s, reason="quota")
        self.extra_headers = header_pairs(headers)


class QuotaTicket:
    """One call's admission: taken at most once, released exactly once."""

    def __init__(self, engine: TenantQuotas, tenant: Tenant) -> None:
        self.engine = engine
        self.tenant = tenant
        self.decision: QuotaDecision | None = None
        self.used: Callable[[], int | None] = lambda: None
        """Tokens the call really used (prompt + generated), for the refund; None: no refund."""
        self._released = False

    async def reserve(self, tokens: int, used: Callable[[], int | None]) -> None:
        """A token route's admission (`Call.quota`): `tokens` reserved, `used` the refund's count."""
        self.used = used
        await self.admit(tokens)

    async def admit(self, tokens: int | None) -> None:
        if self.decision is not None:
            return
        self.decision = await self.engine.admit(self.tenant, tokens)
        if not self.decision.allowed:
            raise refusal(self.tenant, self.decision, tokens)

    def headers(self) -> dict[str, str]:
        return {} if self.decision is None else self.decision.headers()

    async def release(self) -> None:
        if self._released or self.decision is None or self.decision.grant is None:
            return
        self._released = True
        await self.engine.release(self.tenant, self.decision.grant, self.used())


def refusal(tenant: Tenant, decision: QuotaDecision, tokens: int | None) -> ServingError:
    limits = ", ".join(decision.refused_by) or "rate"
    if decision.retry_after_s is None:  # it alone asks more than the window ever grants
        return BadRequest(
            f"this request needs {tokens} tokens (prompt + max_tokens), more than tenant "
            f"{tenant.name!r}'s tokens_per_min ({tenant.config.tokens_per_min}): lower max_tokens"
        )
    retry = decision.retry_after_s
    if decision.refused_by == ("concurrency",):
        retry = min(retry, CONCURRENCY_RETRY_S)
    return QuotaExceeded(
        f"tenant {tenant.name!r} is over its {limits} quota: retry after {retry:.3f} s",
        retry,
        decision.headers(),
    )


class Quotas:
    """The layer (after Auth). Tenants without limits, and anonymous callers, pass untouched."""

    def __init__(self, inner: Handler, engine: Callable[[], TenantQuotas]) -> None:
        self.inner = inner
        self.engine = engine
        self._releases: set[asyncio.Task[None]] = set()

    async def __call__(self, call: Call, request: object) -> Reply:
        tenant = call.tenant
        if tenant.anonymous or not limited(tenant.config):
            return await self.inner(call, request)
        ticket = QuotaTicket(self.engine(), tenant)
        call.quota = ticket
        try:
            if call.route not in TOKEN_ROUTES and not call.reserves_tokens:
                await ticket.admit(None)
            response = await self.inner(call, request)
        except ServingError as exc:
            await ticket.release()
            if not isinstance(exc, QuotaExceeded):
                exc.extra_headers = header_pairs(ticket.headers())
            raise
        except BaseException:
            await ticket.release()
            raise
        response.metadata.extend(header_pairs(ticket.headers()))
        if response.streamed:
            response.on_close(lambda: self._release_later(ticket))
        else:
            await ticket.release()
        return response

    def _release_later(self, ticket: QuotaTicket) -> None:
        task = asyncio.get_running_loop().create_task(ticket.release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)


async def reserve_tokens(call: Call, tokens: int, streams: Sequence[Any]) -> None:
    """A token route's admission, once the handler knows `tokens` (prompt + n x max_tokens); the refund
    at the end counts what `streams` (TokenStreams) really used. Raises the 429 when over quota."""
    if call.quota is None:  # no tenant, or one without limits
        return
    await call.quota.reserve(
        tokens, lambda: streams[0].prompt_tokens + sum(s.completion_tokens for s in streams) if streams else 0
    )
