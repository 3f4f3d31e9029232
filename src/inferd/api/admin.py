"""The admin API, on its own port (default 127.0.0.1:8001): list workers, drain or restart one.

Protected by a bearer token when INFERD_ADMIN_TOKEN is set. Served by aiohttp's web server, which runs
inside the front end's event loop without taking over its signal handling.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from aiohttp import web

from inferd.errors import BadRequest, NotFound

if TYPE_CHECKING:
    from inferd.server import InferenceServer

log = logging.getLogger("inferd.admin")


class AdminApi:
    def __init__(self, server: InferenceServer, token: str | None) -> None:
        self.server = server
        self.token = token
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.get("/admin/workers", self.workers),
                web.get("/admin/models", self.models),
                web.post("/admin/workers/{worker_id}/drain", self.drain),
                web.post("/admin/workers/{worker_id}/restart", self.restart),
                web.post("/admin/models/{model}/scale", self.scale),
                web.post("/admin/models/{model}/update", self.update),
            ]
        )
        return app

    async def start(self, host: str, port: int) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        log.info("admin API on http://%s:%d%s", host, bound, " (token required)" if self.token else "")
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
        except NotFound as exc:
            return web.json_response({"error": exc.message}, status=404)
        except BadRequest as exc:
            return web.json_response({"error": exc.message}, status=400)

    async def workers(self, request: web.Request) -> web.Response:
        now = self.server.clock.now()
        restarts = {slot.worker_id: slot.restarts for slot in self.server.supervisor.slots}
        rows = []
        for rt in self.server.runtimes.values():
            for w in rt.workers:
                rows.append(
                    {
                        "worker_id": w.worker_id,
                        "model": w.model,
                        "version": w.version,
                        "state": w.state.value,
                        "pid": w.pid,
                        "host": w.host,
                        "inflight_batches": len(w.inflight),
                        "completed_batches": w.completed_batches,
                        "restarts": restarts.get(w.slot_id, 0),
                        "last_progress_s_ago": round(now - w.last_progress, 3),
                        "last_heartbeat_s_ago": round(now - w.last_heartbeat, 3),
                        "busy_s": round(w.busy_s, 3),
                        "latency_ms": round(1000 * rt.balancer.latency_s(w.worker_id), 1),
                        "ejection": _ejection(rt.ejection_status(w), now),
                    }
                )
        for llm in self.server.llm_runtimes.values():
            for w in llm.workers:
                rows.append(
                    {
                        "worker_id": w.worker_id,
                        "model": w.model,
                        "version": w.version,
                        "state": w.state.value,
                        "pid": w.pid,
                        "host": w.host,
                        "live_sequences": llm.live_on(w.worker_id),
                        "completed_batches": w.completed_batches,
                        "restarts": restarts.get(w.slot_id, 0),
                        "last_progress_s_ago": round(now - w.last_progress, 3),
                        "last_heartbeat_s_ago": round(now - w.last_heartbeat, 3),
                        "busy_s": round(w.busy_s, 3),
                    }
                )
        return web.json_response({"workers": rows, "time": time.time()})

    async def models(self, request: web.Request) -> web.Response:
        budget = self.server.retry_budget.statistics()
        out = {
            name: {
                "ready": rt.ready,
                "stalled": rt.stalled(),
                "balancer": asdict(rt.balancer.statistics()),
                "ready_workers": rt.ready_workers,
                "queued": len(rt.queue),
                "isolation_batches": len(rt.isolation),
                "batch_timeout_s": rt.batch_timeout_s(),
                "busy_ratio": round(rt.busy_ratio(), 3),
                "autoscaler": loop.report() if (loop := self.server.scaling.get(name)) else None,
            }
            for name, rt in self.server.runtimes.items()
        }
        llm = {
            name: llm_model_row(rt.ready, rt.statistics().detail)
            for name, rt in self.server.llm_runtimes.items()
        }
        return web.json_response(
            {
                "models": out,
                "llm_models": llm,
                "retry_budget": {
                    "balance": round(budget.balance, 1),
                    "requests_in_window": budget.requests_in_window,
                    "retries_in_window": budget.retries_in_window,
                    "exhausted_total": budget.exhausted_total,
                },
            }
        )

    async def drain(self, request: web.Request) -> web.Response:
        rt, worker = self.server.find_worker(request.match_info["worker_id"])
        rt.drain_worker(worker)
        return web.json_response({"worker_id": worker.worker_id, "state": worker.state.value})

    async def scale(self, request: web.Request) -> web.Response:
        """POST /admin/models/{model}/scale?workers=N: add workers, or drain the extra ones."""
        return await _scale(self, request)

    async def update(self, request: web.Request) -> web.Response:
        """POST /admin/models/{model}/update: roll to the repository's highest version, worker by worker.
        Answers when done."""
        return web.json_response(await self.server.fleet.rolling_update(request.match_info["model"]))

    async def restart(self, request: web.Request) -> web.Response:
        """Graceful by default (drain, exit, replaced by the supervisor); ?force=true kills it now."""
        rt, worker = self.server.find_worker(request.match_info["worker_id"])
        if request.query.get("force", "").lower() in ("1", "true", "yes"):
            worker.failure = "restarted by an operator"
            self.server.kill_worker(worker)
        else:
            rt.drain_worker(worker)
        return web.json_response({"worker_id": worker.worker_id, "state": worker.state.value})


def _ejection(record: Any, now: float) -> dict[str, Any]:
    until = record.ejected_until
    return {
        "state": record.state.value,
        "times_ejected": record.times_ejected,
        "ejected_for_s": None if until is None else round(max(0.0, until - now), 3),
        "consecutive_failures": record.consecutive_failures,
        "reason": record.reason,
    }


async def _scale(admin: AdminApi, request: web.Request) -> web.Response:
    try:
        workers = int(request.query["workers"])
    except (KeyError, ValueError):
        raise BadRequest("pass ?workers=N (a whole number of local workers)") from None
    done = await admin.server.fleet.scale_to(request.match_info["model"], workers)
    return web.json_response({"model": request.match_info["model"], "workers": done})


def llm_model_row(ready: bool, s: Any) -> dict[str, Any]:
    """An LLM model as `inferd status` shows it: its engines' sequences, KV use and cache hits."""
    total = s.kv_blocks_total
    return {
        "ready": ready,
        "workers": s.workers,
        "streams": s.streams,
        "running": s.running,
        "waiting": s.waiting,
        "kv_usage": round(s.kv_blocks_used / total, 3) if total else None,
        "prefix_hit_ratio": round(s.prefix_hit_tokens / s.prefix_query_tokens, 3)
        if s.prefix_query_tokens
        else None,
        "preemptions": s.preemptions,
        "rejected": s.rejected,
        "moved": s.moved,
        "lost": s.lost,
    }
