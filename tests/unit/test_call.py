"""The request core's `Call` (core/call.py): handlers and helpers get it as an argument, never through
the HTTP request's scope, and read what the layers learned as typed fields (tenant, quota, priority,
deadline)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest

from inferd.clock import FakeClock
from inferd.config.tenants import TenantConfig
from inferd.core.asgi import HttpRequest, HttpResponse
from inferd.core.call import Call, Handler, chain
from inferd.core.tenant import Tenant
from inferd.errors import BadRequest
from inferd.gateway.quota_layer import Quotas, reserve_tokens
from inferd.gateway.quota_store import InProcessStore, QuotaSettings, TenantQuotas
from inferd.routing.fairness import INTERACTIVE

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "inferd"


def a_call(path: str = "/v1/completions") -> Call:
    scope: dict[str, Any] = {"method": "POST", "path": path, "headers": []}
    return Call(HttpRequest(scope, None, {}), lambda exc, status: b"", route=path)  # type: ignore[arg-type]


def test_no_module_hands_the_call_through_the_request_scope() -> None:
    readers = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py") if "inferd.call" in p.read_text()]
    assert readers == []


def test_a_new_call_has_no_tenant_no_quota_no_deadline_and_interactive_priority() -> None:
    call = a_call()
    assert (call.tenant, call.quota, call.deadline, call.priority) == (None, None, None, INTERACTIVE)


async def test_a_token_route_without_a_limited_tenant_reserves_nothing() -> None:
    await reserve_tokens(a_call(), 10**9, [])  # no quota on the call: nothing to refuse


async def test_the_quotas_layer_hands_a_token_route_its_admission_on_the_call() -> None:
    clock = FakeClock()
    engine = TenantQuotas(InProcessStore(clock), QuotaSettings(), clock)
    run = chain([partial(Quotas, engine=lambda: engine)], reserving(100))
    call = a_call()
    call.tenant = Tenant("acme", TenantConfig(tokens_per_min=150))
    await run(call)  # admitted: 100 of 150 tokens, refunded (nothing used) when it ended
    assert call.quota is not None
    refused = a_call()
    refused.tenant = Tenant("acme", TenantConfig(tokens_per_min=150))
    with pytest.raises(BadRequest, match="needs 200 tokens"):
        await chain([partial(Quotas, engine=lambda: engine)], reserving(200))(refused)


def reserving(tokens: int) -> Handler:
    """A token route's handler: it reserves `tokens` once it knows them."""

    async def handler(call: Call) -> HttpResponse:
        await reserve_tokens(call, tokens, [])
        return HttpResponse(content_type=None)

    return handler
