"""Who is calling: the `Auth` layer of the request chain, and the tenant checks on models.

With any `[tenants.NAME]` configured, every data-plane route needs an API key, as `Authorization:
Bearer KEY` (what OpenAI clients send) or `X-API-Key: KEY`, which the edge reads into `call.credential`
(api/http_call.py): this layer reads the Call, never a header. The key names the tenant (`X-Tenant` is
then ignored); the layer sets `call.tenant` for the layers after it and the handlers. A missing,
unknown or expired key is a 401 with `WWW-Authenticate: Bearer`; a model outside the tenant's `models`
is a 403, and the unknown-model 404 names only the models the tenant may call. The health routes (REST's,
gRPC's ServerLive and ServerReady) and /openapi.json stay open, and /metrics too unless `[gateway]
metrics_require_key = true`. With no tenant configured nothing is enforced and calls carry the edge's
anonymous tenant (core/tenant.py). The repository API's routes (`CONTROL_ROUTES`) find their caller
themselves (`controller`): the admin token, or a tenant key whose table allows model control.

Keys are never logged nor echoed: error messages say what was wrong, never what was sent.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from inferd.core.call import Call, Handler, Reply
from inferd.core.tenant import ANONYMOUS, Tenant
from inferd.errors import Forbidden, NotFound, Unauthorized
from inferd.gateway.keys import KeyStatus
from inferd.gateway.reload import Gate
from inferd.routing.fairness import NO_TENANT, TenantShare

OPEN_PATHS = frozenset(
    {
        "/openapi.json",
        "/v2/health/live",
        "/v2/health/ready",
        "/inference.GRPCInferenceService/ServerLive",
        "/inference.GRPCInferenceService/ServerReady",
    }
)
"""Routes that never need a key (probes, the API description): REST paths, gRPC methods' full names."""
METRICS_PATH = "/metrics"
CONTROL_ROUTES = frozenset(
    {
        "/v2/repository/index",
        "/v2/repository/models/{model}/load",
        "/v2/repository/models/{model}/unload",
        "/inference.GRPCInferenceService/RepositoryIndex",
        "/inference.GRPCInferenceService/RepositoryModelLoad",
        "/inference.GRPCInferenceService/RepositoryModelUnload",
    }
)
"""The repository API's routes: their handlers find the caller (`controller`), who may be the admin
token's holder as well as a tenant, so the Auth layer passes them over."""

_REFUSALS = {
    KeyStatus.MISSING: "an API key is required: send `Authorization: Bearer KEY` or `X-API-Key: KEY`",
    KeyStatus.UNKNOWN: "the API key is not valid",
    KeyStatus.EXPIRED: "the API key has expired: ask for a new one",
}


def needs_key(gate: Gate, route: str) -> bool:
    if not gate.enforced or route in OPEN_PATHS or route in CONTROL_ROUTES:
        return False
    return route != METRICS_PATH or gate.config.metrics_require_key


class Auth:
    """Authenticates each call against the current gate (swapped whole on reload: a call sees one
    consistent set of tenants and keys)."""

    def __init__(self, inner: Handler, gate: Callable[[], Gate]) -> None:
        self.inner = inner
        self.gate = gate

    async def __call__(self, call: Call, request: object) -> Reply:
        gate = self.gate()
        if needs_key(gate, call.route):
            call.tenant = authenticate(gate, call.credential)
        return await self.inner(call, request)


def authenticate(gate: Gate, credential: str | None) -> Tenant:
    """The tenant whose key `credential` is: Unauthorized (missing, unknown or expired) otherwise."""
    found = gate.directory.check(credential)
    if found.tenant is None:
        raise Unauthorized(_REFUSALS[found.status])
    return found.tenant


@dataclass(frozen=True, slots=True)
class Controller:
    """Who calls the repository API: the models it sees (`tenant.may_call`), and whether it may load and
    unload them."""

    tenant: Tenant
    may_control: bool
    why_not: str = ""
    """Why it may not load or unload (the 403's message)."""
    admin: bool = False


def controller(gate: Gate, admin_token: str | None, credential: str | None) -> Controller:
    """The caller of a repository route, by the key it presented (`credential`, read whether tenants are
    configured or not): the admin token (when one is set) sees and controls every model; with tenants, a
    tenant key sees its models and controls them when its table says `model_control = true` (a missing,
    unknown or expired key: Unauthorized); without tenants, anyone sees every model, and controls them
    when no admin token is set."""
    given = None if credential is None else credential.encode("utf-8", "surrogateescape")  # the bytes as sent
    if admin_token and given is not None and hmac.compare_digest(given, admin_token.encode()):
        return Controller(ANONYMOUS, True, admin=True)
    how = "the admin token (Authorization: Bearer <INFERD_ADMIN_TOKEN>)" if admin_token else ""
    if gate.enforced:
        tenant = authenticate(gate, credential)
        why = f"tenant {tenant.name!r} may not load nor unload models: that needs " + (
            f"{how}, or a tenant whose table sets model_control = true" if how else "a tenant whose table sets model_control = true"
        )
        return Controller(tenant, tenant.config.model_control, "" if tenant.config.model_control else why)
    if admin_token is None:
        return Controller(ANONYMOUS, True)
    return Controller(ANONYMOUS, False, f"loading and unloading models needs {how}")


def check_model(tenant: Tenant, name: str, served_names: Callable[[], list[str]]) -> None:
    """The tenant may call `name`: else 404 when it is not served (naming only the tenant's models), or
    403. An anonymous caller: nothing to check (the registry's own 404 names every model)."""
    if tenant.anonymous:
        return
    served = served_names()
    if name not in served:
        raise NotFound(f"unknown model {name!r}; served models: {allowed_models(tenant, served)}")
    if not tenant.may_call(name):
        raise Forbidden(
            f"tenant {tenant.name!r} may not call model {name!r}; it may call: {allowed_models(tenant, served)}"
        )


def tenant_share(tenant: Tenant) -> TenantShare:
    """The caller's lane and weight in a queue (routing/fairness.py): its tenant's, authenticated or
    anonymous (the anonymous caller that names no tenant shares one lane)."""
    return NO_TENANT if tenant.name == "" else TenantShare(tenant.name, tenant.config.weight)


def allowed_models(tenant: Tenant, served: list[str]) -> list[str]:
    return [name for name in served if tenant.may_call(name)]


def tenant_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "inferd_tenant_requests_total",
        "Authenticated requests by tenant and final outcome.",
        ["tenant", "outcome"],
        registry=registry,
    )


class TenantRequests:
    """`inferd_tenant_requests_total{tenant, outcome}`: every authenticated call, by its final outcome
    (a stream when it ends). Tenants come from the config file, so the label set is bounded. Sits
    outside the error layer, where the outcome is known."""

    def __init__(self, inner: Handler, counter: Counter) -> None:
        self.inner = inner
        self.counter = counter

    async def __call__(self, call: Call, request: object) -> Reply:
        try:
            response = await self.inner(call, request)
        except asyncio.CancelledError:  # the edge cancelled the call (a gRPC client left): counted, as a 499 is
            if not call.tenant.anonymous:
                call.outcome = "cancelled"
                self._count(call)
            raise
        if not call.tenant.anonymous:
            if response.streamed:
                response.on_close(lambda: self._count(call))
            else:
                self._count(call)
        return response

    def _count(self, call: Call) -> None:
        self.counter.labels(call.tenant.name, call.outcome).inc()
