"""The gateway's statistics snapshots (quota engine, cache hook), the admin pages built from them, the
quota decisions metric, and `inferd status`'s tenants and cache tables."""

from __future__ import annotations

import json
import time
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from rich.console import Console

from inferd.api.admin_gateway import GatewayView, cache_page, tenants_page
from inferd.api.asgi import HttpResponse
from inferd.api.cache_hook import CacheHook, CacheResult
from inferd.cli.gateway_status import gateway_parts
from inferd.clock import FakeClock
from inferd.config import load_server_config
from inferd.config.tenants import TenantConfig
from inferd.core.call import Call
from inferd.core.tenant import Tenant
from inferd.gateway.auth import tenant_counter
from inferd.gateway.keys import key_digest, new_key
from inferd.gateway.quota_metrics import QuotaCollector
from inferd.gateway.quota_store import (
    InProcessStore,
    QuotaSettings,
    StoreUnavailable,
    TenantQuotas,
    TenantUsage,
)
from inferd.gateway.reload import Gateway
from inferd.observability.cache_metrics import CacheMetrics
from inferd.runtime.registry import ModelRegistry
from tests.unit.test_response_cache import FakeRuntime, bare_call, call_of, sim_config

LIMITED = Tenant("acme", TenantConfig(requests_per_s=0.001, burst=2, max_concurrency=5))
FREE = Tenant("free", TenantConfig())


def engine(clock: FakeClock) -> TenantQuotas:
    return TenantQuotas(InProcessStore(clock), QuotaSettings(), clock)


async def test_quota_statistics_count_each_limited_tenant_and_its_requests_in_flight() -> None:
    quotas = engine(FakeClock())
    first, second, third = [await quotas.admit(LIMITED) for _ in range(3)]
    await quotas.admit(FREE)  # no limit: the engine keeps nothing for it
    assert (first.allowed, second.allowed, third.allowed) == (True, True, False)
    stats = quotas.statistics()
    assert stats.tenants == (("acme", TenantUsage(admitted=2, refused=1, in_flight=2)),)
    assert (stats.admitted, stats.refused) == (2, 1)
    assert first.grant is not None
    await quotas.release(LIMITED, first.grant)
    await quotas.release(LIMITED, first.grant)  # a second release of the same grant frees nothing more
    assert dict(quotas.statistics().tenants)["acme"].in_flight == 1
    with pytest.raises(FrozenInstanceError):
        stats.admitted = 0  # type: ignore[misc]


class DownStore:
    async def update(self, key: str, step: object, keep_s: float) -> object:
        raise StoreUnavailable("connection refused")

    async def close(self) -> None:
        return None


async def test_requests_admitted_while_the_store_is_down_are_counted_apart() -> None:
    quotas = TenantQuotas(DownStore(), QuotaSettings(on_store_error="open"), FakeClock())
    decision = await quotas.admit(LIMITED)
    assert decision.allowed and decision.grant is not None
    assert dict(quotas.statistics().tenants)["acme"] == TenantUsage(admitted_without_store=1, in_flight=1)
    await quotas.release(LIMITED, decision.grant)
    assert dict(quotas.statistics().tenants)["acme"].in_flight == 0
    assert not quotas.statistics().store_up


async def test_quota_decisions_metric_is_read_from_the_engine_at_scrape_time() -> None:
    quotas = engine(FakeClock())
    registry = CollectorRegistry()
    registry.register(QuotaCollector(lambda: quotas))
    for _ in range(3):
        await quotas.admit(LIMITED)

    def decisions(result: str) -> float | None:
        return registry.get_sample_value("inferd_quota_decisions_total", {"tenant": "acme", "result": result})

    assert (decisions("admitted"), decisions("refused"), decisions("admitted_without_store")) == (2, 1, 0)
    assert (
        registry.get_sample_value("inferd_quota_decisions_total", {"tenant": "free", "result": "admitted"})
        is None
    )


async def responses(hook: CacheHook, rt: FakeRuntime, results: list[str | None]) -> None:
    async def handler(call: Call, request: object) -> HttpResponse:
        call.runtime = rt  # type: ignore[assignment]
        return HttpResponse(content_type=None)

    layer = CacheResult(handler, hook)
    for result in results:
        call = bare_call()
        if result is not None:
            call.notes["cache"] = result
        await layer(call, None)


async def test_cache_statistics_count_responses_by_result_and_what_the_stores_hold() -> None:
    clock, registry = FakeClock(), ModelRegistry()
    rt = FakeRuntime("sim", 1, sim_config())
    registry.add(rt)  # type: ignore[arg-type]
    hook = CacheHook(registry, CacheMetrics(CollectorRegistry()), clock)
    assert hook.statistics() == ()

    async def compute() -> tuple[str, int]:
        return "answer", 100

    for inputs in ("a", "b", "a"):
        await hook.answer(call_of(None), rt, inputs, compute)  # type: ignore[arg-type]
    await responses(hook, rt, ["miss", "miss", "hit", None])  # what the layer saw: the last bypassed
    (stats,) = hook.statistics()
    assert (stats.model, stats.hits, stats.misses, stats.bypass) == ("sim", 1, 2, 1)
    assert (stats.entries, stats.bytes, stats.hit_ratio) == (2, 200, pytest.approx(1 / 3))
    assert cache_page_of(hook)["sim"]["hit_ratio"] == 0.3333


def cache_page_of(hook: CacheHook) -> dict:
    view = GatewayView(None, None, hook.statistics)  # type: ignore[arg-type]
    return cache_page(view)["models"]


def test_an_unasked_cache_has_no_hit_ratio() -> None:
    hook = CacheHook(ModelRegistry(), CacheMetrics(CollectorRegistry()), FakeClock())
    hook.count("sim", "bypass")
    (stats,) = hook.statistics()
    assert (stats.bypass, stats.hit_ratio) == (1, None)


KEY, OTHER = new_key(), new_key()


def gateway(tmp_path: Path) -> Gateway:
    path = tmp_path / "inferd.toml"
    path.write_text(
        f"""
[tenants.acme]
api_key_sha256 = ["{key_digest(KEY)}", "{key_digest(OTHER)}"]
models = ["sim"]
requests_per_s = 0.001
burst = 2

[tenants.free]
api_key_sha256 = ["{key_digest(new_key())}"]
"""
    )
    return Gateway(load_server_config(path, {}, environ={}), lambda: ["sim"])


async def test_tenants_page_shows_limits_usage_and_outcomes_and_never_a_key(tmp_path: Path) -> None:
    gw = gateway(tmp_path)
    counter = tenant_counter(CollectorRegistry())
    acme = gw.current().directory.tenants["acme"]
    for _ in range(3):
        await gw.quotas.admit(acme)
    counter.labels("acme", "ok").inc(2)
    counter.labels("acme", "rate_limited").inc()
    counter.labels("free", "ok").inc(5)
    page = tenants_page(GatewayView(gw, counter, lambda: ()))
    assert page["enforced"] is True
    assert page["quota_store"] == {"shared": False, "up": True, "on_store_error": "open", "store_errors": 0}
    assert page["tenants"]["acme"] == {
        "limits": {
            "requests_per_s": 0.001,
            "burst": 2,
            "tokens_per_min": None,
            "max_concurrency": None,
            "weight": 1.0,
            "models": ["sim"],
        },
        "keys": 2,
        "quota": {"admitted": 2, "refused": 1, "admitted_without_store": 0, "in_flight": 2},
        "requests": {"ok": 2, "rate_limited": 1},
    }
    assert page["tenants"]["free"]["quota"] is None  # no limit: the engine is not consulted
    assert page["tenants"]["free"]["requests"] == {"ok": 5}
    text = json.dumps(page)
    for secret in (KEY, OTHER, key_digest(KEY), key_digest(OTHER), key_digest(KEY)[:12]):
        assert secret not in text


def render(parts: list) -> str:
    console = Console(width=250, record=True)
    for part in parts:
        console.print(part)
    return console.export_text()


def test_status_shows_tenants_and_cache_tables_only_when_they_have_rows() -> None:
    assert gateway_parts(None, None) == []
    assert gateway_parts({"enforced": False, "tenants": {}}, {"models": {}}) == []
    tenants = {
        "acme": {
            "limits": {"requests_per_s": 5, "burst": 10, "max_concurrency": 4, "models": ["sim"]},
            "keys": 2,
            "quota": {"admitted": 40, "refused": 3, "in_flight": 1},
            "requests": {"ok": 38, "rate_limited": 3, "timeout": 2},
        },
        "free": {"limits": {"models": []}, "keys": 1, "quota": None, "requests": {"ok": 7}},
    }
    cache = {
        "sim": {"hits": 30, "misses": 10, "bypass": 2, "hit_ratio": 0.75, "entries": 10, "bytes": 5 * 1024**2}
    }
    out = render(gateway_parts({"tenants": tenants, "quota_store": {"up": True}}, {"models": cache}))
    assert "tenants" in out and "response cache" in out
    acme = next(line for line in out.splitlines() if "acme" in line).split()
    assert acme[:6] == ["│", "acme", "│", "2", "│", "sim"]
    assert "5/s (burst 10)" in out
    assert [c for c in acme if c.isdigit()][-5:] == ["40", "3", "1", "38", "5"]  # admitted .. failed
    assert "unlimited" in next(line for line in out.splitlines() if "free" in line)
    for text in ("75%", "5.0 MiB", "30", "10"):
        assert text in out
    assert "quota store" not in out
    down = render(
        gateway_parts(
            {"tenants": tenants, "quota_store": {"up": False, "store_errors": 4, "on_store_error": "closed"}},
            None,
        )
    )
    assert "quota store: UNREACHABLE, 4 errors" in down and "refused (503)" in down
    assert "response cache" not in down


def test_status_shows_each_split_with_its_weights_canary_step_and_state_and_the_history() -> None:
    assert gateway_parts(None, None, {"splits": [], "history": []}) == []
    traffic = {
        "splits": [
            {
                "model": "sim",
                "mode": "canary",
                "weights": {"1": 0.5, "2": 0.5},
                "canary_version": 2,
                "step": 1,
                "state": "active",
                "steps": [0.1, 0.5, 1.0],
            },
            {
                "model": "failing",
                "mode": "canary",
                "weights": {"1": 1.0, "2": 0.0},
                "canary_version": 2,
                "step": 0,
                "state": "rolled_back",
                "steps": [0.3],
            },
            {
                "model": "ab",
                "mode": "ab",
                "weights": {"10": 0.25, "2": 0.75},
                "canary_version": None,
                "step": 0,
                "state": "active",
                "steps": [],
            },
        ],
        "history": [
            {"model": "sim", "version": 2, "event": "step", "reason": "weight 0.5", "at": 1_800_000_000.0},
            {
                "model": "failing",
                "version": 2,
                "event": "rolled_back",
                "reason": "canary error ratio 0.400 over the bound 0.1",
                "at": 1_800_000_060.0,
            },
        ],
    }
    out = render(gateway_parts(None, None, traffic))
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    assert "canary" in rows["sim"] and "v1 0.5, v2 0.5" in rows["sim"]
    assert "2/3 (0.1 > 0.5 > 1)" in rows["sim"] and "active" in rows["sim"]
    assert "rolled_back" in rows["failing"] and "fixed" in rows["failing"] and "v1 1, v2 0" in rows["failing"]
    assert "v2 0.75, v10 0.25" in rows["ab"]  # versions in numeric order
    history = out[out.index("traffic history") :].splitlines()
    assert "sim v2  step: weight 0.5" in history[1]
    assert "failing v2  rolled_back: canary error ratio 0.400 over the bound 0.1" in history[2]
    assert time.strftime("%Y-%m-%d %H:%M", time.localtime(1_800_000_060.0)) in history[2]


# ---- inferd bench --header (how the gateway overhead benchmark sends its key) -----------------------
async def test_bench_sends_extra_headers_and_never_shows_their_values() -> None:
    from inferd.bench.http_clients import RawClient
    from inferd.bench.load_spec import LoadSpec
    from inferd.bench.loadgen import spec_dict
    from inferd.bench.spec_checks import parse_header

    header = parse_header(f"Authorization:  Bearer {KEY} ")
    assert header == ("Authorization", f"Bearer {KEY}")
    spec = LoadSpec(url="http://127.0.0.1:9", headers=(header, parse_header("X-Tenant-Hint: a:b")))
    request = RawClient.for_spec(spec, lambda: 0.0).build(b"{}", 1.0)
    assert f"\r\nAuthorization: Bearer {KEY}\r\nX-Tenant-Hint: a:b\r\n".encode() in request
    assert KEY not in repr(spec)
    assert spec_dict(spec)["headers"] == ["Authorization", "X-Tenant-Hint"]
    for bad in ("no colon here", ": value"):
        with pytest.raises(ValueError, match="Name: value"):
            parse_header(bad)
    with pytest.raises(ValueError, match="CR or LF"):
        LoadSpec(headers=(("X-A", "v\r\nX-Injected: 1"),))
