"""The request core's `Call` (core/call.py): handlers and helpers get it as an argument, never through
the HTTP request's scope, and read what the edge parsed and the layers learned as typed fields (tenant,
quota, priority, deadline). The core knows no HTTP: the Call holds no request, and neither core/ nor the
gateway's layers import the HTTP edge."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from inferd.api.asgi import HttpResponse
from inferd.clock import FakeClock
from inferd.config.tenants import TenantConfig
from inferd.core.call import Call, Handler, chain
from inferd.core.disconnect import STAYING
from inferd.core.tenant import ANONYMOUS, Tenant
from inferd.errors import BadRequest
from inferd.gateway.quota_layer import Quotas, reserve_tokens
from inferd.gateway.quota_store import InProcessStore, QuotaSettings, TenantQuotas
from inferd.routing.fairness import INTERACTIVE

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "inferd"


def a_call(path: str = "/v1/completions") -> Call:
    return Call(lambda exc, status: b"", STAYING, route=path, method="POST", target=path)


def test_no_module_hands_the_call_through_the_request_scope() -> None:
    readers = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py") if "inferd.call" in p.read_text()]
    assert readers == []


def test_a_new_call_is_anonymous_with_no_quota_no_deadline_and_interactive_priority() -> None:
    call = a_call()
    assert (call.tenant, call.quota, call.deadline, call.priority) == (ANONYMOUS, None, None, INTERACTIVE)
    assert call.tenant.anonymous and call.tenant.name == ""


def test_the_call_holds_no_http_request() -> None:
    fields = Call.__dataclass_fields__  # type: ignore[attr-defined]
    assert "request" not in fields
    assert not any("Http" in str(f.type) or "Peer" in str(f.type) for f in fields.values())


@pytest.mark.parametrize("folder", ["core", "gateway"])
def test_the_core_and_the_gateway_import_nothing_of_the_http_edge(folder: str) -> None:
    importers = [
        p.relative_to(PACKAGE)
        for p in (PACKAGE / folder).rglob("*.py")
        if "inferd.api" in p.read_text() or "HttpRequest" in p.read_text() or "StreamingResponse" in p.read_text()
    ]
    assert importers == []


async def test_a_token_route_without_a_limited_tenant_reserves_nothing() -> None:
    await reserve_tokens(a_call(), 10**9, [])  # no quota on the call: nothing to refuse


async def test_the_quotas_layer_hands_a_token_route_its_admission_on_the_call() -> None:
    clock = FakeClock()
    engine = TenantQuotas(InProcessStore(clock), QuotaSettings(), clock)
    run = chain([partial(Quotas, engine=lambda: engine)], reserving(100))
    call = a_call()
    call.tenant = Tenant("acme", TenantConfig(tokens_per_min=150))
    await run(call, None)  # admitted: 100 of 150 tokens, refunded (nothing used) when it ended
    assert call.quota is not None
    refused = a_call()
    refused.tenant = Tenant("acme", TenantConfig(tokens_per_min=150))
    with pytest.raises(BadRequest, match="needs 200 tokens"):
        await chain([partial(Quotas, engine=lambda: engine)], reserving(200))(refused, None)


def reserving(tokens: int) -> Handler:
    """A token route's handler: it reserves `tokens` once it knows them."""

    async def handler(call: Call, request: object) -> HttpResponse:
        await reserve_tokens(call, tokens, [])
        return HttpResponse(content_type=None)

    return handler
