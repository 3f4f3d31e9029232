"""Model control's states and rules (fleet/model_control.py) over a fake server, and who may call the
repository API (gateway/auth.py `controller`); the repository watch's changes (fleet/repository_watch.py).
Workers are the integration tests' (tests/integration/test_repository_api.py, test_model_poll.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from inferd.api.repository import Repository, check_parameters
from inferd.config import ConfigError, ModelConfig, ServerConfig
from inferd.config.tenants import TenantConfig
from inferd.core.tenant import Tenant
from inferd.errors import (
    BadRequest,
    ClusterUnavailable,
    Forbidden,
    NotFound,
    ServingError,
    Unauthorized,
    WorkerUnavailable,
)
from inferd.fleet.model_control import ModelControl, ModelState
from inferd.fleet.repository_watch import RepositoryWatch, fingerprints
from inferd.gateway.auth import Controller, controller
from inferd.gateway.config import TenantsTable
from inferd.gateway.keys import key_digest
from inferd.gateway.reload import build_gate
from inferd.kinds.repository import load_repository
from inferd.runtime.registry import ModelRegistry
from inferd.wire.connection import WorkerState

SIM = 'builtin = "sim"\n'


@dataclass
class FakeRuntime:
    name: str
    version: int
    config: ModelConfig
    kind: str = "batch"
    ready: bool = True
    queued: int = 0

    def statistics(self) -> Any:
        return SimpleNamespace(queued=self.queued, in_flight=0)


class FakeKinds:
    def get(self, kind: str) -> Any:
        return SimpleNamespace(has_workers=False, rolls_versions=kind != "search")  # workers: the integration tests'

    def check(self, config: ModelConfig) -> None:
        return None


@dataclass
class FakeServer:
    registry: ModelRegistry = field(default_factory=ModelRegistry)
    kinds: FakeKinds = field(default_factory=FakeKinds)
    fleet: Any = field(default_factory=lambda: SimpleNamespace(directory=SimpleNamespace(workers=lambda n, v: ())))
    pools: Any = field(  # none pooled
        default_factory=lambda: SimpleNamespace(manager_for=lambda config: None, unready=lambda model, version: None)
    )
    added: list[tuple[str, int]] = field(default_factory=list)
    removed: list[tuple[str, int, str]] = field(default_factory=list)
    """(model, version, the message what it still held failed with: "" the default)."""

    def add_version(self, config: ModelConfig) -> Any:
        rt = FakeRuntime(config.name, config.version, config)
        self.registry.add(rt)  # type: ignore[arg-type]
        self.added.append((config.name, config.version))
        return rt

    def remove_version(self, name: str, version: int, why: ServingError | None = None) -> None:
        self.registry.remove(name, version)
        self.removed.append((name, version, "" if why is None else why.message))


def repo_of(tmp_path: Path, *names: str) -> Path:
    for name in names:
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "model.toml").write_text(SIM)
    return tmp_path / "models"


@contextlib.asynccontextmanager
async def running(
    tmp_path: Path, names: tuple[str, ...] = ("a", "b"), others: Any = None, **settings: Any
) -> AsyncIterator[tuple[ModelControl, FakeServer]]:
    repo = repo_of(tmp_path, *names)
    server = FakeServer()
    control = ModelControl(server, ServerConfig(model_repo=repo, **settings), others)  # type: ignore[arg-type]
    for config in control.at_start_models(load_repository(repo)):
        server.add_version(config)
    task = asyncio.create_task(control.run())
    await asyncio.sleep(0)
    try:
        yield control, server
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def states(control: ModelControl) -> dict[str, tuple[str, ModelState, str]]:
    return {r.name: (r.version, r.state, r.reason) for r in control.index(lambda name: True)}


async def test_unload_refuses_new_requests_at_once_and_stops_serving_once_drained(tmp_path: Path) -> None:
    async with running(tmp_path) as (control, server):
        rt = server.registry.get("a")
        rt.queued = 2  # type: ignore[attr-defined]
        unloading = asyncio.create_task(control.unload("a"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert "a" in server.registry  # what it holds is answered first
        with pytest.raises(NotFound, match=r"model 'a' is unloaded: load it with POST /v2/repository/models/a/load"):
            control.refuse_unloaded("a")
        rt.queued = 0  # type: ignore[attr-defined]
        await unloading
        assert "a" not in server.registry
        assert states(control) == {"a": ("", ModelState.UNAVAILABLE, "unloaded"), "b": ("1", ModelState.READY, "")}
        assert [r.name for r in control.index(lambda name: True, ready_only=True)] == ["b"]
        control.refuse_unloaded("b")  # served: nothing to refuse


async def test_load_serves_the_repository_version_and_concurrent_loads_join_one(tmp_path: Path) -> None:
    async with running(tmp_path) as (control, server):
        await control.unload("a")
        server.added.clear()
        await asyncio.gather(control.load("a"), control.load("a"))
        assert server.added == [("a", 1)]  # one load, both answered
        assert states(control)["a"] == ("1", ModelState.READY, "")
        control.refuse_unloaded("a")


async def test_explicit_serves_load_models_only_and_the_rest_load_on_demand(tmp_path: Path) -> None:
    async with running(tmp_path, model_control="explicit", load_model=("b",)) as (control, server):
        assert server.registry.names() == ["b"]
        assert states(control)["a"] == ("", ModelState.UNAVAILABLE, "not loaded")
        with pytest.raises(NotFound, match="not loaded"):
            control.refuse_unloaded("a")
        await control.load("a")
        assert server.registry.names() == ["a", "b"]


async def test_unknown_models_are_404_and_a_broken_folder_400(tmp_path: Path) -> None:
    async with running(tmp_path) as (control, server):
        with pytest.raises(NotFound, match="unknown model 'nope'"):
            await control.load("nope")
        with pytest.raises(NotFound, match="unknown model 'nope'"):
            await control.unload("nope")
        (tmp_path / "models" / "a" / "model.toml").write_text("builtin = [\n")
        await control.unload("a")
        with pytest.raises(BadRequest, match="not valid TOML"):
            await control.load("a")
        assert "a" not in server.registry


async def test_with_several_front_ends_one_that_does_not_decide_refuses_load_and_unload_503(tmp_path: Path) -> None:
    """The holder of the lease carries them out (api/repository.py forwards there): tests/unit/test_control_share.py."""

    def not_holder() -> None:
        raise ClusterUnavailable("this front end does not hold the lease of the server's decisions now")

    others = SimpleNamespace(holds=lambda: False, check_holder=not_holder)
    async with running(tmp_path, others=others) as (control, server):
        for act in (control.load, control.unload):
            with pytest.raises(ClusterUnavailable, match="does not hold the lease"):
                await act("a")
        assert server.registry.names() == ["a", "b"] and not control.unloaded


async def test_a_load_that_is_not_ready_in_time_is_503_and_leaves_it_unloaded(tmp_path: Path) -> None:
    async with running(tmp_path) as (control, server):
        await control.unload("a")
        control.ready_timeout_s = 0.01
        server.kinds = SimpleNamespace(get=lambda kind: SimpleNamespace(has_workers=True, rolls_versions=True), check=lambda c: None)  # type: ignore[assignment]
        directory = SimpleNamespace(workers=lambda name, version: (), changed=_never)  # no worker ever joins
        launcher = SimpleNamespace(add=lambda *a: [])
        server.fleet = SimpleNamespace(launcher=launcher, scale_to=_no_workers, directory=directory)
        with pytest.raises(WorkerUnavailable, match=r"no worker was ready within 0.01 s"):
            await control.load("a")
        assert "a" not in server.registry
        (row,) = [r for r in control.index(lambda name: True) if r.name == "a"]
        assert row.state is ModelState.UNAVAILABLE and row.reason.startswith("its last load failed: model 'a' version 1: no worker was ready")


async def _never(model: str, version: int) -> None:
    await asyncio.Event().wait()


async def _no_workers(model: str, workers: int, version: int | None = None) -> int:
    return workers


def test_load_model_needs_explicit() -> None:
    with pytest.raises(ValidationError, match="--model-control explicit"):
        ServerConfig(load_model=("a",))
    ServerConfig(model_control="explicit", load_model=("*",))


def test_explicit_load_model_naming_an_unknown_model_is_refused(tmp_path: Path) -> None:
    repo = repo_of(tmp_path, "a")
    control = ModelControl(FakeServer(), ServerConfig(model_repo=repo, model_control="explicit", load_model=("zz",)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"--load-model names unknown models \['zz'\]"):
        control.at_start_models(load_repository(repo))


def test_triton_overrides_are_refused_by_name() -> None:
    check_parameters(["unload_dependents", "priority"])
    with pytest.raises(BadRequest, match=r"\['config', 'file:1/model.onnx'\]"):
        check_parameters(["file:1/model.onnx", "config"])


# ---- who may call -------------------------------------------------------------------------------------
OPS, PLAIN = "ik-ops-key-0001", "ik-plain-key-0002"


def gate(tenants: bool) -> Any:
    tables = {
        "ops": TenantConfig(api_key_sha256=(key_digest(OPS),), model_control=True),
        "plain": TenantConfig(api_key_sha256=(key_digest(PLAIN),), models=("a",)),
    }
    config = ServerConfig(tables={"tenants": TenantsTable(tables)} if tenants else {})
    return build_gate(config, ["a", "b"], lambda: 0.0)


def test_the_admin_token_and_model_control_tenants_may_control_others_may_not() -> None:
    with_tenants = gate(True)
    admin = controller(with_tenants, "tok", "tok")
    assert admin.may_control and admin.admin and admin.tenant.may_call("b")
    ops = controller(with_tenants, "tok", OPS)
    assert ops.may_control and ops.tenant.name == "ops"
    plain = controller(with_tenants, "tok", PLAIN)
    assert not plain.may_control and "model_control = true" in plain.why_not and "admin token" in plain.why_not
    assert [m for m in ("a", "b") if plain.tenant.may_call(m)] == ["a"]  # the index: its models only
    with pytest.raises(Unauthorized):
        controller(with_tenants, "tok", None)
    with pytest.raises(Unauthorized):
        controller(with_tenants, None, "tok")  # no admin token set: "tok" is just an unknown key


def test_without_tenants_the_admin_token_decides() -> None:
    open_gate = gate(False)
    assert controller(open_gate, None, None).may_control  # an open server: anyone
    assert not controller(open_gate, "tok", None).may_control
    assert not controller(open_gate, "tok", "wrong").may_control
    assert controller(open_gate, "tok", "tok").may_control


def test_the_watch_reports_added_changed_and_removed_model_folders(tmp_path: Path) -> None:
    repo = repo_of(tmp_path, "a", "b")
    watch = RepositoryWatch(fingerprints(repo))
    assert watch.update(fingerprints(repo)) == watch.update(fingerprints(repo))  # nothing changed: empty
    (repo / "a" / "2").mkdir()
    (repo / "c").mkdir()
    (repo / "c" / "model.toml").write_text(SIM)
    (repo / "b" / "model.toml").unlink()
    changes = watch.update(fingerprints(repo))
    assert (changes.added, changes.changed, changes.removed) == (("c",), ("a",), ("b",))
    assert fingerprints(repo, only=("a",)).keys() == {"a"}


async def test_a_search_index_is_not_unloaded_through_the_repository_api(tmp_path: Path) -> None:
    async with running(tmp_path) as (control, server):
        a = server.registry.get("a")
        server.registry.add(FakeRuntime("idx", 1, a.config, kind="search"))  # type: ignore[arg-type]
        with pytest.raises(BadRequest, match="'idx' is a search model"):
            await control.unload("idx")
        control.refuse_unloaded("idx")  # still served


def test_a_key_that_is_not_utf8_is_refused_not_an_error() -> None:
    raw = b"\xff\xfe-not-utf8".decode("utf-8", "surrogateescape")  # as the edges read header bytes
    assert not controller(gate(False), "tok", raw).may_control
    with pytest.raises(Unauthorized):
        controller(gate(True), "tok", raw)


async def test_a_model_new_to_the_repository_is_loading_while_it_loads_and_holds_no_readiness_down(tmp_path: Path) -> None:
    """A model whose folder appeared after the start (never served, never unloaded) and is loaded: while its
    workers start it is LOADING in the index, its requests are told it loads, and the server's readiness
    does not wait for it (as for a model loaded again after an unload)."""
    async with running(tmp_path) as (control, server):
        (tmp_path / "models" / "c").mkdir()
        (tmp_path / "models" / "c" / "model.toml").write_text(SIM)
        joined = asyncio.Event()
        worker = SimpleNamespace(state=WorkerState.READY)
        directory = SimpleNamespace(workers=lambda name, version: (worker,) if joined.is_set() else (), changed=lambda n, v: joined.wait())
        server.kinds = SimpleNamespace(get=lambda kind: SimpleNamespace(has_workers=True, rolls_versions=True), check=lambda c: None)  # type: ignore[assignment]
        server.fleet = SimpleNamespace(launcher=SimpleNamespace(add=lambda *a: []), scale_to=_no_workers, directory=directory)
        loading = asyncio.create_task(control.load("c"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert "c" in server.registry and not loading.done()  # served, its worker not ready yet
        assert states(control)["c"] == ("", ModelState.LOADING, "loading")
        with pytest.raises(WorkerUnavailable, match="'c' is loading"):
            control.refuse_unloaded("c")
        server.registry.get("c").ready = False  # type: ignore[attr-defined]  # no worker yet
        assert all(rt.ready for rt in server.registry if rt.name not in control.unloaded)  # the server's `ready`
        server.registry.get("c").ready = True  # type: ignore[attr-defined]
        joined.set()
        await loading
        assert states(control)["c"] == ("1", ModelState.READY, "")
        control.refuse_unloaded("c")


async def test_a_caller_that_may_not_load_is_refused_403_whatever_it_sends() -> None:
    """Load and unload are refused to any key that may not control models (403), before its parameters
    are looked at: Triton's overrides from such a caller are a 403 too, not a 400."""
    control = SimpleNamespace(load=_never_called, unload=_never_called)
    config = SimpleNamespace(worker_start_timeout_s=1.0)  # one front end: no peers to forward to
    repo = Repository(SimpleNamespace(model_control=control, peers=None, config=config))  # type: ignore[arg-type]
    plain = Controller(Tenant("plain", TenantConfig(models=("a",))), False, "tenant 'plain' may not load nor unload models")
    for parameters in ([], ["config"], ["file:1/model.onnx"]):
        with pytest.raises(Forbidden, match="may not load nor unload"):
            await repo.load(plain, "a", parameters)
    with pytest.raises(Forbidden):
        await repo.unload(plain, "a")
    ops = Controller(Tenant("ops", TenantConfig(model_control=True)), True)
    with pytest.raises(BadRequest, match="config"):  # one that may: told what it sent is refused
        await repo.load(ops, "a", ["config"])


async def _never_called(name: str) -> None:
    raise AssertionError(f"model control was asked about {name!r}")


async def until(done: Any) -> None:
    for _ in range(500):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not done in 5 s")


async def polling(tmp_path: Path, server: FakeServer) -> None:
    """Until the poll watches the repository: a model folder added now is served (its first read of the
    folder runs off the event loop: a change made before it would be its starting point, not a change)."""
    folder = tmp_path / "models" / "zz"
    folder.mkdir()
    (folder / "model.toml").write_text(SIM)
    for i in range(500):  # changed again until seen (the first read may already hold the folder)
        if "zz" in server.registry:
            return
        (folder / f"touched-{i}").write_text("")
        await asyncio.sleep(0.01)
    raise AssertionError("the poll never served a new model folder")


async def test_poll_reports_a_new_folder_that_does_not_load_in_the_index(tmp_path: Path) -> None:
    """A model folder new to the repository whose model.toml does not parse is not served, and the index
    says why (as for a served model's broken folder), not merely that it is not loaded."""
    async with running(tmp_path, model_control="poll", repository_poll_s=0.01) as (control, server):
        await polling(tmp_path, server)
        (tmp_path / "models" / "c").mkdir()
        (tmp_path / "models" / "c" / "model.toml").write_text("builtin = [\n")
        await until(lambda: "c" in control.broken)
        assert "c" not in server.registry
        version, state, reason = states(control)["c"]
        assert (version, state) == ("", ModelState.UNAVAILABLE) and "not valid TOML" in reason, reason
        (tmp_path / "models" / "c" / "model.toml").write_text(SIM)  # fixed: served at the next poll
        await until(lambda: "c" in server.registry)
        assert states(control)["c"] == ("1", ModelState.READY, "")


async def test_poll_survives_a_model_folder_it_may_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A served model's folder the server may not read (EACCES: another user's, mode 0700; simulated, as
    the tests may run as root) is a folder that fails to read: the poll goes on, the old version serves on,
    the index says why. It once raised out of the poll, stopping model control and with it the server."""
    async with running(tmp_path, model_control="poll", repository_poll_s=0.01) as (control, server):
        await polling(tmp_path, server)
        locked = tmp_path / "models" / "a"
        real_stat, real_iterdir = Path.stat, Path.iterdir

        def stat(self: Path, **kw: Any) -> Any:
            if locked in self.parents:
                raise PermissionError(13, "Permission denied", str(self))
            return real_stat(self, **kw)

        def iterdir(self: Path) -> Any:
            if self == locked or locked in self.parents:
                raise PermissionError(13, "Permission denied", str(self))
            return real_iterdir(self)

        monkeypatch.setattr(Path, "stat", stat)
        monkeypatch.setattr(Path, "iterdir", iterdir)
        await until(lambda: "a" in control.broken)
        assert control._tg is not None  # model control runs on
        assert "a" in server.registry  # what served serves on
        version, state, reason = states(control)["a"]
        assert (version, state) == ("1", ModelState.READY) and "Permission denied" in reason, reason
        monkeypatch.undo()  # readable again: no longer reported
        await until(lambda: "a" not in control.broken)
        assert states(control)["a"] == ("1", ModelState.READY, "")
