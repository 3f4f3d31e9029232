"""A real pool worker process (`python -m inferd.worker.main --pool p`) against a scripted front end
(tests/pool_front.py): LoadModel -> a model link that is Ready at once and serves batches -> UnloadModel
drains it and gives its memory back; loads that fail or cannot fit are answered with the cause;
max_loaded_models evicts the least recently used model (after min_resident_s), and so does memory, at
a model's measured size; a local pool worker exits with its front end; SIGTERM drains every model server
before the process exits 0."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import msgspec
import pytest

from inferd.models.sim import sim_digest
from inferd.wire import protocol as p
from tests.pool_front import PoolFront, model_json, resident_mb, serve_one_batch, start_pool_worker, stop

pytestmark = pytest.mark.slow

MEMORY_MB = 200


def answers(model: str, *inputs: str) -> list[dict[str, bytes]]:
    """A sim model's outputs for `inputs`, as a BatchDone carries them."""
    return [{"OUTPUT0": sim_digest(model, 1, x).encode()} for x in inputs]


def held(state: p.PoolState) -> dict[str, str]:
    return {m.model: m.state for m in state.models}


async def test_a_load_is_served_by_a_model_link_and_an_unload_drains_it_and_gives_its_memory_back(
    tmp_path: Path,
) -> None:
    socket_path = tmp_path / "fe.sock"
    a = model_json("a", memory_mb=MEMORY_MB, load_ms=100)
    async with PoolFront(socket_path, {"memory_budget_mb": 1000.0, "min_resident_s": 0.0}, {"a": a}) as front:
        proc = await start_pool_worker(socket_path, tmp_path / "worker.log")
        try:
            pool = await front.pool_link()
            assert pool.hello.pool == "p" and pool.hello.worker_id == "pw-1"
            first = await pool.expect(p.PoolState)
            assert (first.budget_mb, first.used_mb, first.models) == (1000.0, 0.0, [])
            before_mb = resident_mb(proc.pid)

            pool.send(p.LoadModel("a", 1, a, wait_s=5.0))
            result = await pool.expect(p.LoadResult)
            assert result.ok and (result.model, result.version) == ("a", 1), result
            assert result.memory_mb >= 0.8 * MEMORY_MB, result  # measured: the sim touched its 200 MiB
            assert result.load_s >= 0.1
            loaded_mb = resident_mb(proc.pid)
            assert loaded_mb - before_mb >= 0.8 * MEMORY_MB
            state = await pool.expect(p.PoolState, where=lambda s: held(s) == {"a": "ready"})
            assert state.used_mb == result.memory_mb and state.loads == {"a": 1}

            link = await front.model_link()
            assert (link.hello.model, link.hello.version, link.hello.pool) == ("a", 1, "p")
            assert link.hello.credits and link.hello.worker_id == "pw-1"
            ready = await link.expect(p.Ready)
            assert (ready.version, ready.load_s) == (1, 0.0)  # loaded before it joined
            done = await serve_one_batch(link, 7, [b"x", b"y"])
            assert done.batch_error is None and done.outputs == answers("a", "x", "y")

            pool.send(p.UnloadModel("a", 1))
            await link.expect(p.Drain)  # the model server drains: nothing of ours is on it, so answer at once
            link.send(p.Drain())
            await asyncio.wait_for(link.closed.wait(), 20)
            state = await pool.expect(p.PoolState, where=lambda s: s.models == [])
            assert state.used_mb == 0.0 and state.evictions == {}  # asked to unload: not an eviction
            assert resident_mb(proc.pid) <= loaded_mb - 0.8 * MEMORY_MB  # unloaded, collected, trimmed
        finally:
            await stop(proc)


async def test_a_load_that_fails_or_cannot_fit_is_answered_with_its_cause(tmp_path: Path) -> None:
    socket_path = tmp_path / "fe.sock"
    broken = msgspec.json.decode(model_json("broken"), type=dict)
    broken["implementation"] = "tests.no_such_module:Nothing"
    big = {**msgspec.json.decode(model_json("big"), type=dict), "memory_mb": 5000.0}
    async with PoolFront(socket_path, {"memory_budget_mb": 1000.0}, {}) as front:
        proc = await start_pool_worker(socket_path, tmp_path / "worker.log")
        try:
            pool = await front.pool_link()
            pool.send(p.LoadModel("broken", 1, msgspec.json.encode(broken)))
            failed = await pool.expect(p.LoadResult)
            assert not failed.ok and failed.model == "broken"
            assert "no_such_module" in failed.error, failed
            pool.send(p.LoadModel("big", 1, msgspec.json.encode(big)))
            refused = await pool.expect(p.LoadResult)
            assert not refused.ok and refused.model == "big"
            assert "5000 MB" in refused.error and "1000 MB" in refused.error, refused
            state = await pool.expect(p.PoolState)
            assert state.models == [] and state.loads == {}
            assert front.model_links.empty()
        finally:
            await stop(proc)


async def test_max_loaded_models_evicts_the_least_recently_used_once_it_may(tmp_path: Path) -> None:
    """One model at most, protected for 0.5 s after its load: the load of b waits for a to age, then a is
    drained and unloaded (an eviction) and b loads."""
    socket_path = tmp_path / "fe.sock"
    models = {"a": model_json("a"), "b": model_json("b")}
    config = {"memory_budget_mb": 1000.0, "max_loaded_models": 1, "min_resident_s": 0.5}
    async with PoolFront(socket_path, config, models) as front:
        proc = await start_pool_worker(socket_path, tmp_path / "worker.log")
        try:
            pool = await front.pool_link()
            pool.send(p.LoadModel("a", 1, models["a"], wait_s=10.0))
            assert (await pool.expect(p.LoadResult)).ok
            a = await front.model_link()
            await a.expect(p.Ready)
            pool.send(p.LoadModel("b", 1, models["b"], wait_s=10.0))
            waiting = await pool.expect(p.PoolState, where=lambda s: s.waiting_loads == 1)
            assert held(waiting) == {"a": "ready"}
            await a.expect(p.Drain)  # a aged past min_resident_s: evicted
            a.send(p.Drain())
            result = await pool.expect(p.LoadResult)
            assert result.ok and result.model == "b", result
            state = await pool.expect(p.PoolState, where=lambda s: held(s) == {"b": "ready"})
            assert state.evictions == {"a": 1} and state.loads == {"a": 1, "b": 1}
            b = await front.model_link()
            assert b.hello.model == "b"
            await b.expect(p.Ready)
            done = await serve_one_batch(b, 1, [b"q"])
            assert done.outputs == answers("b", "q")
        finally:
            await stop(proc)


async def test_sigterm_drains_every_model_server_then_the_pool_link(tmp_path: Path) -> None:
    socket_path = tmp_path / "fe.sock"
    models = {"a": model_json("a"), "b": model_json("b")}
    async with PoolFront(socket_path, {"memory_budget_mb": 1000.0}, models) as front:
        proc = await start_pool_worker(socket_path, tmp_path / "worker.log")
        try:
            pool = await front.pool_link()
            for name in models:
                pool.send(p.LoadModel(name, 1, models[name]))
                assert (await pool.expect(p.LoadResult)).ok
            links = {}
            for _ in models:
                link = await front.model_link()
                links[link.hello.model] = link
            await links["a"].expect(p.Ready)
            await links["a"].expect(p.Credit, where=lambda c: c.granted > 0)
            links["a"].send(p.RunBatch(3, [b"late"]))
            proc.send_signal(signal.SIGTERM)
            for link in links.values():
                await link.expect(p.Drain)
            done = await links["a"].expect(p.BatchDone)  # what it held finishes and is delivered
            assert done.outputs == answers("a", "late")
            for link in links.values():
                link.send(p.Drain())
            await pool.expect(p.Drain)
            assert await asyncio.wait_for(proc.wait(), 20) == 0
        finally:
            await stop(proc)


async def test_a_local_pool_worker_exits_when_the_front_end_that_runs_it_goes(tmp_path: Path) -> None:
    socket_path = tmp_path / "fe.sock"
    models = {"a": model_json("a", memory_mb=20)}
    async with PoolFront(socket_path, {"memory_budget_mb": 1000.0}, models) as front:
        proc = await start_pool_worker(socket_path, tmp_path / "worker.log", reconnect=False)
        try:
            pool = await front.pool_link()
            pool.send(p.LoadModel("a", 1, models["a"]))
            assert (await pool.expect(p.LoadResult)).ok
            await (await front.model_link()).expect(p.Ready)
            await front.close()
            assert await asyncio.wait_for(proc.wait(), 20) == 0
            assert "unloaded a v1" in (tmp_path / "worker.log").read_text()
        finally:
            await stop(proc)


async def test_a_model_is_planned_at_its_measured_size_and_what_does_not_fit_evicts_the_idle_one(
    tmp_path: Path,
) -> None:
    """No estimate in the configs: a's first load is planned at 0 MB and measured at ~120 MB. Once a was
    unloaded and b loaded (~120 MB), a's next load is planned at what it measured: with b's it would not
    fit the 200 MB budget, so b (idle, past min_resident_s = 0) is evicted first."""
    socket_path = tmp_path / "fe.sock"
    models = {name: model_json(name, memory_mb=120) for name in ("a", "b")}
    async with PoolFront(socket_path, {"memory_budget_mb": 200.0, "min_resident_s": 0.0}, models) as front:
        proc = await start_pool_worker(socket_path, tmp_path / "worker.log")
        try:
            pool = await front.pool_link()
            pool.send(p.LoadModel("a", 1, models["a"]))
            measured = (await pool.expect(p.LoadResult)).memory_mb
            assert 100.0 <= measured <= 200.0, measured
            a = await front.model_link()
            await a.expect(p.Ready)
            pool.send(p.UnloadModel("a", 1))
            await a.expect(p.Drain)
            a.send(p.Drain())
            await pool.expect(p.PoolState, where=lambda s: s.models == [])
            pool.send(p.LoadModel("b", 1, models["b"]))
            assert (await pool.expect(p.LoadResult)).ok
            b = await front.model_link()
            await b.expect(p.Ready)
            pool.send(p.LoadModel("a", 1, models["a"]))
            planned = await pool.expect(p.PoolState, where=lambda s: held(s) == {"b": "unloading"})
            assert planned.waiting_loads == 1  # a waits for b's memory
            await b.expect(p.Drain)
            b.send(p.Drain())
            again = await pool.expect(p.LoadResult)
            assert again.ok and again.model == "a"
            state = await pool.expect(p.PoolState, where=lambda s: held(s) == {"a": "ready"})
            assert state.evictions == {"b": 1} and state.used_mb <= 200.0
        finally:
            await stop(proc)
