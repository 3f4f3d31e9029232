"""UpstreamRuntime as a Runtime (inferd.runtime.contract): kind "upstream", no workers, its snapshot
(the pool's statistics and the retries), readiness while forwarding, and a deadline that has passed
before an attempt."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from inferd.clock import FakeClock
from inferd.errors import DeadlineExceeded, Internal, ShuttingDown
from inferd.kinds.upstream.metrics import UpstreamMetrics
from inferd.kinds.upstream.reply import UpstreamStatistics
from inferd.kinds.upstream.runtime import UpstreamRuntime, openai_upstream_config
from inferd.observability.metrics import Metrics
from inferd.routing.retry import RetryBudget
from inferd.runtime.contract import Runtime
from inferd.wire.connection import WorkerConnection

URLS = ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"]


def make() -> tuple[UpstreamRuntime, FakeClock]:
    clock = FakeClock()
    config = openai_upstream_config("big", {}, params={"upstreams": URLS, "probe_interval_s": 3600})
    rt = UpstreamRuntime(config, clock, UpstreamMetrics(Metrics(), "big"), RetryBudget(clock))
    return rt, clock


def test_an_upstream_model_is_a_runtime_without_workers() -> None:
    rt, _ = make()
    assert isinstance(rt, Runtime) and rt.kind == "upstream" and not rt.accepts_workers
    assert not hasattr(rt, "members")  # it takes no Membership (tests/unit/test_worker_directory.py)
    with pytest.raises(Internal, match="takes no workers"):
        rt.add_worker(WorkerConnection("w-0.0", "big", 1, "local", None))  # type: ignore[arg-type]
    s = rt.statistics()
    assert (s.kind, s.name, s.version, s.workers, s.ready_workers, s.queued, s.in_flight) == (
        "upstream",
        "big",
        1,
        (),
        0,
        0,
        0,
    )
    assert isinstance(s.detail, UpstreamStatistics) and s.detail.retries == 0
    assert [u.upstream for u in s.detail.upstreams] == URLS
    assert not s.ready, "not forwarding before run() opened its connection pool"


@contextlib.asynccontextmanager
async def fake_engine(seen: list[str | None]) -> AsyncIterator[str]:
    """An upstream that answers probes and takes 10 s to answer a completion (recording the deadline
    header it was sent)."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def complete(request: web.Request) -> web.Response:
        seen.append(request.headers.get("X-Request-Timeout-Ms"))
        await asyncio.sleep(10.0)
        return web.json_response({"choices": []})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    runner = web.AppRunner(app, handler_cancellation=True)  # a client that left ends its handler
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


async def test_a_deadline_travels_upstream_as_the_time_left_and_bounds_the_call() -> None:
    seen: list[str | None] = []
    async with fake_engine(seen) as url:
        clock = FakeClock()
        config = openai_upstream_config("big", {}, params={"upstreams": [url], "probe_interval_s": 3600})
        rt = UpstreamRuntime(config, clock, UpstreamMetrics(Metrics(), "big"), RetryBudget(clock))
        task = asyncio.ensure_future(rt.run())
        try:
            for _ in range(200):
                if rt.ready:
                    break
                await asyncio.sleep(0.01)
            assert rt.ready, "the forwarding runtime never became ready"
            with pytest.raises(DeadlineExceeded, match="before an upstream answered"):
                await rt.send("/completions", b"{}", deadline=clock.now())
            assert seen == [], "a request past its deadline was sent"
            with pytest.raises(DeadlineExceeded, match="waiting for upstream"):
                await rt.send("/completions", b"{}", deadline=clock.now() + 0.2)
            assert seen == ["200"]
            s = rt.statistics()
            assert s.in_flight == 0 and s.detail.upstreams[0].failures == 0  # not the upstream's fault
            rt.stop(ShuttingDown("bye"))
            assert not rt.ready
            with pytest.raises(ShuttingDown):
                await rt.send("/completions", b"{}")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
