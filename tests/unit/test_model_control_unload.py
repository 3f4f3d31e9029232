"""An unload's races and failures (fleet/model_control.py): a request that passed the unloaded check before
the unload is the model's work until answered (`hold` to `release`), what a version's queue holds past the
bounded wait fails as unloaded (404), not 503; a store failure during an unload's wait rolls the mark back (the model
serves on, as its 503 says) on the holder and, with the document written again, on the others. A model
loaded with several versions scales on the [autoscale] table of the version that serves by default. Over
the fakes of tests/unit/test_model_control.py and test_control_share.py (a MemoryStore made to fail);
the edges' side: tests/integration/test_repository_api.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inferd.cluster.store import StoreUnavailable
from inferd.config import ServerConfig
from inferd.errors import ClusterUnavailable, NotFound
from inferd.fleet.model_control import ModelState
from inferd.kinds.repository import load_repository
from tests.unit.test_control_share import follow, index, two_fronts, until_done, until_written
from tests.unit.test_model_control import running

UNLOADED_404 = "model 'a' is unloaded: load it with POST /v2/repository/models/a/load"


async def test_an_unload_waits_for_a_request_that_passed_the_check_before_it(tmp_path: Path) -> None:
    """A request resolved its model (the check passed) and is still sending its body when the unload
    finds the model's queue empty and nothing running: the unload waits for its answer."""
    async with running(tmp_path) as (control, server):
        control.hold("a")  # Api.run_oip: the model resolved, its body not read yet
        unloading = asyncio.create_task(control.unload("a"))
        await asyncio.sleep(0.2)  # the drain looks every 0.05 s
        assert not unloading.done() and "a" in server.registry  # the request is answered by the model
        with pytest.raises(NotFound, match=UNLOADED_404):
            control.refuse_unloaded("a")  # a new request: refused at once
        control.hold("a")  # two at once, both counted
        control.release("a")
        await asyncio.sleep(0.1)
        assert not unloading.done() and control.held("a")
        control.release("a")  # answered
        assert not control.held("a")
        await unloading
        assert "a" not in server.registry


async def test_what_is_left_past_the_bounded_wait_is_refused_as_unloaded_never_503(tmp_path: Path) -> None:
    """A request that never ends its body holds the unload at most ready_timeout_s; then the versions go,
    and what they still hold fails with the unloaded 404, not "no longer served" (503)."""
    async with running(tmp_path) as (control, server):
        control.ready_timeout_s = 0.1
        control.hold("a")
        await control.unload("a")
        assert server.removed == [("a", 1, UNLOADED_404)]
        control.release("a")  # its answer, whenever it comes, leaves nothing behind
        assert not control.held("a")


async def test_a_store_failure_during_an_unloads_wait_rolls_the_mark_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder marked the model unloaded and wrote it; front end 1 refuses it and holds its work; the
    store fails while the holder waits on the reports: 503, and the model serves on, on the holder at once
    (not refused, READY) and on front end 1 once the holder writes the document again."""
    async with two_fronts(tmp_path) as (holder, other):
        busy = other.server.registry.get("a")
        busy.queued = 1  # type: ignore[attr-defined]  # a request of a held on front end 1
        unloading = asyncio.ensure_future(holder.control.unload("a"))
        await until_written(holder, lambda state: "a" in state.unloaded)
        await follow(other)
        with pytest.raises(NotFound, match=UNLOADED_404):
            other.control.refuse_unloaded("a")

        async def down(prefix: str) -> Any:
            raise StoreUnavailable("no answer within 2 s")

        monkeypatch.setattr(holder.versions.store, "read_prefix", down)
        with pytest.raises(ClusterUnavailable, match="the cluster store does not answer"):
            await unloading
        assert "a" in holder.server.registry and "a" not in holder.control.unloaded
        holder.control.refuse_unloaded("a")  # served on, as the 503 says: not refused here
        assert index(holder)["a"] == ("1", ModelState.READY, "")
        monkeypatch.undo()  # the store answers again: the holder's loop writes the document
        await holder.versions.publish()
        await follow(other)
        other.control.refuse_unloaded("a")  # served again there too
        assert index(other)["a"] == ("1", ModelState.READY, "")
        busy.queued = 0  # type: ignore[attr-defined]
        await until_done(asyncio.ensure_future(holder.control.unload("a")), other)  # an unload again ends it
        assert "a" not in holder.server.registry


async def test_a_failure_after_the_workers_were_told_to_stop_leaves_it_unloaded(tmp_path: Path) -> None:
    """Past the first scale-down the model is no longer served whole: it stays unloaded (refused), and an
    unload again ends it."""
    async with running(tmp_path) as (control, server):
        (tmp_path / "models" / "a" / "model.toml").write_text('builtin = "sim"\nversion_policy = "all"\n[versions.2]\n')
        control.ready_timeout_s = 0.1
        server.registry.remove("a", 1)
        for config in control.read("a"):
            server.add_version(config)
        scaled: list[int] = []

        async def scale_to(model: str, workers: int, version: int | None = None) -> int:
            if scaled:
                raise ClusterUnavailable("the cluster store does not answer: changes are refused")
            scaled.append(version or 0)
            return workers

        server.kinds = SimpleNamespace(get=lambda kind: SimpleNamespace(has_workers=True, rolls_versions=True), check=lambda c: None)  # type: ignore[assignment]
        server.fleet = SimpleNamespace(scale_to=scale_to, directory=SimpleNamespace(workers=lambda n, v: ()))
        with pytest.raises(ClusterUnavailable):
            await control.unload("a")
        assert scaled == [1] and server.registry.versions("a") == [2]  # version 1 went, version 2 failed
        with pytest.raises(NotFound, match=UNLOADED_404):
            control.refuse_unloaded("a")
        scaled.clear()
        server.fleet.scale_to = _scaled  # the store answers again
        await control.unload("a")
        assert "a" not in server.registry


async def _scaled(model: str, workers: int, version: int | None = None) -> int:
    return workers


SEVERAL = """builtin = "sim"
version_policy = "all"
default_version = 1
workers = 0
[versions.1.autoscale]
min_workers = 0
max_workers = 2
[versions.2.autoscale]
min_workers = 0
max_workers = 5
"""


async def test_a_model_loaded_with_several_versions_scales_on_its_default_versions_table(tmp_path: Path) -> None:
    """Versions 1 and 2 loaded while serving, version 1 the default (default_version): its scaling loop is
    made from version 1's [autoscale] table, not from that of the version served first (the highest)."""
    from inferd.server import InferenceServer

    repo = tmp_path / "models"
    for name, toml in (("m", SEVERAL), ("b", 'builtin = "sim"\nworkers = 0\n')):
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(toml)
    config = ServerConfig(
        port=0, admin_port=None, grpc_port=None, data_dir=tmp_path / "data", model_repo=repo,
        model_control="explicit", load_model=("b",),
    )
    server = InferenceServer(config, load_repository(repo), spawn_workers=False)
    assert "m" not in server.registry and "m" not in server.autoscaling.loops
    control = server.model_control
    task = asyncio.create_task(control.run())
    await asyncio.sleep(0)
    try:
        await control.load("m")
        assert server.registry.versions("m") == [1, 2] and server.registry.default_version("m") == 1
        assert server.autoscaling.loops["m"].autoscaler.config.max_workers == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
