"""The admin API's gateway pages: tenants with their limits and usage (GET /admin/tenants), and the
response cache per model (GET /admin/cache). Read through snapshots: the current gate, the quota
engine's `statistics()`, the `inferd_tenant_requests_total` counter and the cache hook's
`statistics()`. Never a key nor a key digest: a tenant shows how many keys it has, nothing more."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import Counter

from inferd.api.cache_hook import ModelCacheStatistics
from inferd.config.tenants import TenantConfig
from inferd.gateway.quota_store import TenantUsage, limited
from inferd.gateway.reload import Gateway


@dataclass(frozen=True, slots=True)
class GatewayView:
    """What the gateway pages read (built by the composition root)."""

    gateway: Gateway
    tenant_requests: Counter
    """`inferd_tenant_requests_total{tenant, outcome}`: every authenticated call by its final outcome."""
    cache: Callable[[], tuple[ModelCacheStatistics, ...]]


def tenants_page(view: GatewayView) -> dict[str, Any]:
    """Each configured tenant: its limits, how many keys it has, its quota decisions on this front end
    (tenants with a limit) and its requests by outcome; and the quota store's state."""
    gate = view.gateway.current()
    quotas = view.gateway.quotas.statistics()
    usage = dict(quotas.tenants)
    outcomes = requests_by_tenant(view.tenant_requests)
    tenants = {
        name: tenant_row(tenant.config, usage.get(name), outcomes.get(name, {}))
        for name, tenant in sorted(gate.directory.tenants.items())
    }
    return {
        "enforced": gate.enforced,
        "tenants": tenants,
        "quota_store": {
            "shared": gate.config.redis_url is not None,
            "up": quotas.store_up,
            "on_store_error": gate.config.on_store_error,
            "store_errors": quotas.store_errors,
        },
    }


def tenant_row(config: TenantConfig, usage: TenantUsage | None, requests: dict[str, int]) -> dict[str, Any]:
    return {
        "limits": {
            "requests_per_s": config.requests_per_s,
            "burst": config.burst,
            "tokens_per_min": config.tokens_per_min,
            "max_concurrency": config.max_concurrency,
            "weight": config.weight,
            "models": list(config.models),
        },
        "keys": len(config.api_key_sha256),
        "quota": None if not limited(config) else asdict(usage or TenantUsage()),
        "requests": requests,
    }


def requests_by_tenant(counter: Counter) -> dict[str, dict[str, int]]:
    """tenant -> outcome -> requests, from the counter's own samples."""
    found: dict[str, dict[str, int]] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                tenant, outcome = sample.labels["tenant"], sample.labels["outcome"]
                found.setdefault(tenant, {})[outcome] = int(sample.value)
    return found


def cache_page(view: GatewayView) -> dict[str, Any]:
    """Each cache-enabled model that was asked or holds answers: responses by cache result, the hit
    ratio (hits over hits + misses) and what its stores hold."""
    return {
        "models": {
            s.model: {
                **{k: v for k, v in asdict(s).items() if k != "model"},
                "hit_ratio": None if s.hit_ratio is None else round(s.hit_ratio, 4),
            }
            for s in view.cache()
        }
    }
