"""The admin API, on its own port: list workers and models (every kind, every served version), drain or
restart a worker, scale a model, roll it to any version; the gateway's tenants and response cache
(api/admin_gateway.py).

Protected by a bearer token when INFERD_ADMIN_TOKEN is set. Served by aiohttp's web server, which runs
inside the front end's event loop without taking over its signal handling.
"""

from __future__ import annotations

import hmac
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from inferd.api.admin_gateway import GatewayView, cache_page, tenants_page
from inferd.api.errors import error_headers, status_of
from inferd.clock import Clock
from inferd.config import ConfigError
from inferd.errors import BadRequest, ClusterUnavailable, Conflict, NotFound
from inferd.fleet.control import FleetControl
from inferd.fleet.scaling import ScalingLoop
from inferd.routing.retry import RetryBudget
from inferd.runtime.admin_view import AdminView, fleet_rows, plain
from inferd.runtime.contract import Runtime, RuntimeStatistics, WorkerSnapshot
from inferd.runtime.frontend_load import FrontendLoads, model_load
from inferd.runtime.kinds import KindRegistry
from inferd.runtime.membership import WorkerDirectory
from inferd.runtime.registry import ModelRegistry
from inferd.wire.connection import WorkerConnection, slot_of
from inferd.worker.launcher import Launcher

log = logging.getLogger("inferd.admin")

FORWARDED = "X-Inferd-Forwarded"
"""Marks a change forwarded to the front end that decides (it is not forwarded again)."""
FORWARD_TIMEOUT_S = 900.0
"""A forwarded update answers when done: as long as its workers take to start, one by one."""


@dataclass(frozen=True, slots=True)
class AdminTarget:
    """What the admin API operates on (built by the composition root)."""

    registry: ModelRegistry
    kinds: KindRegistry
    """Each kind's admin view (`Kind.admin`): the keys its rows add."""
    fleet: FleetControl
    launcher: Launcher[Any]
    retry_budget: RetryBudget
    scaling: Mapping[str, ScalingLoop]
    clock: Clock
    kill_worker: Callable[[WorkerConnection], None]
    directory: WorkerDirectory
    """Every served version's workers (runtime/membership.py): drain and restart find theirs here."""
    reload: Callable[[], Awaitable[Mapping[str, Any]]] | None = None
    """Re-read the config file's tenants, keys, [gateway] table and the models' traffic and cache tables
    (ConfigError: refused whole)."""
    gateway: GatewayView | None = None
    """Tenants, quotas and the response cache, for GET /admin/tenants and GET /admin/cache."""
    traffic: Callable[[], Any] | None = None
    """The traffic splits' snapshot: weights, state, rollback and promotion history."""
    loads: FrontendLoads | None = None
    """The other front ends' reported loads (the owner of several front ends): batch models' queued
    items and busy ratio are then the whole server's."""
    frontend: Mapping[str, str | None] | None = None
    """This front end as GET /admin/workers shows it: {"id": config.frontend_id(), "zone": ...}."""
    decider: Callable[[], Awaitable[str | None]] | None = None
    """The admin address (HOST:PORT) of the front end that decides for the server when it is another
    (cluster/frontend.py): a change (scale, update) asked here is carried out there. None: here."""
    cluster: Callable[[], Awaitable[Mapping[str, Any]]] | None = None
    """GET /admin/cluster: the live front ends, the lease's holder, a model repository mismatch
    (cluster/frontend.py `ClusterFrontend.view`)."""
    grpc: Callable[[], str | None] | None = None
    """HOST:PORT of the server's gRPC API (the one bound, for port 0 too), as GET /admin/workers shows
    it; None (or answering None): no gRPC API."""
    pools: Callable[[], Mapping[str, Any]] | None = None
    """GET /admin/pools: each pool's workers, their budgets, use and models (fleet/pools.py)."""


class AdminApi:
    def __init__(self, target: AdminTarget, token: str | None) -> None:
        self.target = target
        self.token = token
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.get("/admin/workers", self.workers),
                web.get("/admin/models", self.models),
                web.get("/admin/cluster", self.cluster),
                web.post("/admin/workers/{worker_id}/drain", self.drain),
                web.post("/admin/workers/{worker_id}/restart", self.restart),
                web.post("/admin/models/{model}/scale", self.scale),
                web.post("/admin/models/{model}/update", self.update),
                web.post("/admin/reload", self.reload),
                # the gateway's state, one page per concern
                web.get("/admin/tenants", self.tenants),
                web.get("/admin/cache", self.cache),
                web.get("/admin/traffic", self.traffic),
                web.get("/admin/pools", self.pools),
            ]
        )
        return app

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Listen on host:port, over TLS (the HTTP API's certificate) when `tls` is given."""
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=tls)
        await site.start()
        bound = self._runner.addresses[0][1]
        scheme = "https" if tls else "http"
        log.info("admin API on %s://%s:%d%s", scheme, host, bound, " (token required)" if self.token else "")
        return bound

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.token:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                return web.json_response(
                    {"error": "missing or wrong admin token (Authorization: Bearer ...)"}, status=401
                )
        try:
            return await handler(request)
        except (NotFound, BadRequest, Conflict) as exc:  # 404, 400, 409 (a rolling update refused)
            return web.json_response({"error": exc.message}, status=status_of(exc)[0])
        except ClusterUnavailable as exc:  # 503: the cluster store is down, or the lease is not held here
            headers = {k.decode(): v.decode() for k, v in error_headers(exc)}
            return web.json_response({"error": exc.message}, status=status_of(exc)[0], headers=headers)

    async def workers(self, request: web.Request) -> web.Response:
        t = self.target
        now = t.clock.now()
        restarts = {slot.worker_id: slot.restarts for slot in t.launcher.slots}
        rows = [
            worker_row(stats, w, now, restarts.get(slot_of(w.worker_id), 0), t.kinds.get(stats.kind).admin)
            for rt in t.registry
            for stats in (rt.statistics(),)
            for w in stats.workers
        ]
        grpc = t.grpc() if t.grpc is not None else None
        return web.json_response({"workers": rows, "time": time.time(), "frontend": t.frontend, "grpc": grpc})

    async def cluster(self, request: web.Request) -> web.Response:
        """The front ends that form the server (those whose records are live in the shared store)."""
        if self.target.cluster is None:
            raise NotFound("this server has no cluster to report on")
        return web.json_response(dict(await self.target.cluster()))

    async def traffic(self, request: web.Request) -> web.Response:
        """Canary and A/B splits now, and why canaries were rolled back or promoted (newest last)."""
        snapshot = self.target.traffic() if self.target.traffic is not None else None
        return web.json_response(plain(snapshot) if snapshot is not None else {"splits": [], "history": []})

    async def models(self, request: web.Request) -> web.Response:
        t = self.target
        budget = t.retry_budget.statistics()
        sections: dict[str, dict[str, Any]] = {"models": {}, "llm_models": {}, "other_models": {}}
        every = [(rt, rt.statistics()) for rt in t.registry]
        fleets = fleet_rows(stats for _, stats in every)
        for rt, stats in every:
            default = t.registry.default_version(rt.name) == rt.version
            key = rt.name if len(t.registry.versions(rt.name)) == 1 else f"{rt.name}:{rt.version}"
            row = {"kind": stats.kind, "version": stats.version, "default": default, "fleet": fleets.get(rt.name, [])}
            loop = t.scaling.get(rt.name) if default else None
            row["autoscaler"] = loop.report() if loop is not None else None
            kind = t.kinds.get(stats.kind)
            row.update(kind.admin.model_row(stats))
            if kind.queues_per_frontend and t.loads is not None:
                whole = t.loads.total(model_load(stats, 0.0))  # every front end's queue and busy time
                row.update(queued=whole.queued_items, busy_ratio=round(whole.busy_ratio, 3))
            sections.setdefault(kind.admin.section, {})[key] = row
        return web.json_response(
            {
                **sections,
                "retry_budget": {
                    "balance": round(budget.balance, 1),
                    "requests_in_window": budget.requests_in_window,
                    "retries_in_window": budget.retries_in_window,
                    "exhausted_total": budget.exhausted_total,
                },
            }
        )

    async def drain(self, request: web.Request) -> web.Response:
        rt, worker = self._find(request.match_info["worker_id"])
        rt.drain_worker(worker)
        return web.json_response({"worker_id": worker.worker_id, "state": worker.state.value})

    async def scale(self, request: web.Request) -> web.Response:
        """POST /admin/models/{model}/scale?workers=N[&version=V]: add workers, or drain the extra ones."""
        try:
            workers = int(request.query["workers"])
        except (KeyError, ValueError):
            raise BadRequest("pass ?workers=N (a whole number of local workers)") from None
        model = request.match_info["model"]
        version = _version(request)
        if (there := await self._forwarded(request)) is not None:
            return there
        done = await self.target.fleet.scale_to(model, workers, version)
        return web.json_response({"model": model, "workers": done})

    async def update(self, request: web.Request) -> web.Response:
        """POST /admin/models/{model}/update[?version=N]: roll to version N (default: the repository's
        highest; lower versions roll back), worker by worker. Answers when done."""
        if (there := await self._forwarded(request)) is not None:
            return there
        model = request.match_info["model"]
        return web.json_response(await self.target.fleet.rolling_update(model, _version(request)))

    async def _forwarded(self, request: web.Request) -> web.Response | None:
        """A change asked of a front end that does not decide: its answer from the one that does (once:
        a forwarded change is carried out, or refused, where it lands). None: carry it out here."""
        if self.target.decider is None or request.headers.get(FORWARDED):
            return None
        where = await self.target.decider()
        if where is None:
            return None
        headers = {FORWARDED: "1"}
        if (token := request.headers.get("Authorization")) is not None:  # (any case: a multidict)
            headers["Authorization"] = token
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S)) as http:
                async with http.post(f"{request.scheme}://{where}{request.path_qs}", headers=headers) as r:
                    body = await r.read()
                    kept = {h: v for h in ("Retry-After",) if (v := r.headers.get(h)) is not None}
                    return web.Response(status=r.status, body=body, content_type="application/json", headers=kept)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ClusterUnavailable(f"the front end that decides ({where}) did not answer: {exc!r}") from None

    async def reload(self, request: web.Request) -> web.Response:
        """POST /admin/reload: re-read the --config file and swap in its tenants, API keys, [gateway]
        table and the models' traffic and cache tables at once (the answer's `changed` says what
        changed and what needs a restart); a file that does not validate is refused whole (400 with the
        reason) and the running settings stay."""
        if self.target.reload is None:
            raise NotFound("this server has nothing to reload")
        try:
            summary = await self.target.reload()
        except ConfigError as exc:
            log.warning("admin reload refused, the running tenants, keys and models stay: %s", exc)
            raise BadRequest(f"config not reloaded: {exc}") from None
        return web.json_response({"reloaded": True, **summary})

    async def tenants(self, request: web.Request) -> web.Response:
        """GET /admin/tenants: each tenant's limits, key count, quota decisions and requests by outcome."""
        return web.json_response(tenants_page(self._gateway()))

    async def cache(self, request: web.Request) -> web.Response:
        """GET /admin/cache: the response cache per model (hits, misses, bypass, entries, bytes)."""
        return web.json_response(cache_page(self._gateway()))

    async def pools(self, request: web.Request) -> web.Response:
        """GET /admin/pools: each pool's settings; each pool worker's budget, use, models held (state,
        memory, idle, evictable) and waiting loads; each pooled model's demand and load backoff."""
        return web.json_response(self.target.pools() if self.target.pools is not None else {"pools": []})

    def _find(self, worker_id: str) -> tuple[Runtime, WorkerConnection]:
        """A ready or draining worker and the runtime of the version it serves (NotFound: none)."""
        model, version, worker = self.target.directory.find(worker_id)
        return self.target.registry.get(model, version), worker

    def _gateway(self) -> GatewayView:
        if self.target.gateway is None:
            raise NotFound("this server has no gateway to report on")
        return self.target.gateway

    async def restart(self, request: web.Request) -> web.Response:
        """Graceful by default (drain, exit, replaced by the supervisor); ?force=true kills it now."""
        rt, worker = self._find(request.match_info["worker_id"])
        if request.query.get("force", "").lower() in ("1", "true", "yes"):
            worker.failure = "restarted by an operator"
            self.target.kill_worker(worker)
        else:
            rt.drain_worker(worker)
        return web.json_response({"worker_id": worker.worker_id, "state": worker.state.value})


def _version(request: web.Request) -> int | None:
    raw = request.query.get("version")
    if raw is None or raw == "":
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise BadRequest(f"version must be a whole number >= 1, got {raw!r}")
    return int(raw)


def worker_row(
    stats: RuntimeStatistics, w: WorkerSnapshot, now: float, restarts: int, view: AdminView
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "worker_id": w.worker_id,
        "model": w.model,
        "version": w.version,
        "kind": stats.kind,
        "state": w.state,
        "pid": w.pid,
        "host": w.host,
        "zone": w.zone,
        "load": w.load,
        "completed_batches": w.completed,
        "restarts": restarts,
        "last_progress_s_ago": round(now - w.last_progress_at, 3),
        "last_heartbeat_s_ago": round(now - w.last_heartbeat_at, 3),
        "busy_s": round(w.busy_s, 3),
    }
    return {**row, **view.worker_row(w, now)}
