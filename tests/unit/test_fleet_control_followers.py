"""A rolling update with several front ends (fleet/control.py with Followers): the new version's workers
start only once the other front ends serve it, and when one does not, nothing changes."""

from __future__ import annotations

from types import SimpleNamespace

import aiohttp
import pytest

from inferd.api.admin import AdminApi
from inferd.clock import FakeClock
from inferd.errors import ClusterUnavailable, Conflict
from inferd.fleet.control import FleetControl
from inferd.runtime.membership import WorkerDirectory
from inferd.runtime.registry import ModelRegistry


def runtime(version: int) -> SimpleNamespace:
    config = SimpleNamespace(name="sim", version=version, kind="batch", default_version=None, pool=None)
    return SimpleNamespace(name="sim", version=version, kind="batch", config=config)


class Host:
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self.removed: list[int] = []

    def add_version(self, config: SimpleNamespace) -> SimpleNamespace:
        rt = runtime(config.version)
        self.registry.add(rt)  # type: ignore[arg-type]
        return rt

    def remove_version(self, name: str, version: int) -> None:
        self.registry.remove(name, version)
        self.removed.append(version)

    def has_workers(self, kind: str) -> bool:
        return True


class Launcher:
    def __init__(self) -> None:
        self.added: list[int] = []

    def live_slots(self, model: str, version: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(worker_id=f"sim-{i}", index=i) for i in range(2)] if version == 1 else []

    def add(self, model: str, n: int, version: int) -> list[SimpleNamespace]:
        self.added.append(version)
        raise AssertionError("a worker started before the other front ends serve its version")


class Refusing:
    def __init__(self) -> None:
        self.fleet: FleetControl | None = None
        self.updates_seen: dict[str, tuple[int, int, int]] = {}

    async def until_serving(self, model: str, version: int) -> None:
        assert self.fleet is not None
        self.updates_seen = self.fleet.updates()  # what the owner saves meanwhile (cluster/saved.py, cluster/served.py)
        raise Conflict(f"front end(s) [1] do not serve version {version} of {model!r}")

    async def until_moved(self, model: str, old: int, new: int) -> None:
        raise AssertionError("not reached")


async def test_an_update_a_follower_cannot_serve_changes_nothing() -> None:
    registry = ModelRegistry()
    registry.add(runtime(1))  # type: ignore[arg-type]
    host, launcher = Host(registry), Launcher()
    fleet = FleetControl(
        registry,
        launcher,  # type: ignore[arg-type]
        host,  # type: ignore[arg-type]
        WorkerDirectory(FakeClock()),
        load_version=lambda model, version: SimpleNamespace(name=model, version=2, kind="batch", pool=None),  # type: ignore[arg-type,return-value]
        followers=(followers := Refusing()),
    )
    followers.fleet = fleet
    with pytest.raises(Conflict, match="do not serve version 2"):
        await fleet.rolling_update("sim")
    assert followers.updates_seen == {"sim": (1, 2, 2)}  # running: from 1 to 2, replacing 2 workers
    assert fleet.updates() == {}  # ended
    assert launcher.added == [] and host.removed == [2]
    assert registry.versions("sim") == [1] and registry.default_version("sim") == 1


async def test_the_admin_api_answers_a_refused_update_with_409() -> None:
    async def refused(model: str, version: int | None) -> dict[str, object]:
        raise Conflict("front end(s) [1] do not serve version 2 of 'sim'; nothing was changed")

    api = AdminApi(SimpleNamespace(fleet=SimpleNamespace(rolling_update=refused), decider=None), None)  # type: ignore[arg-type]
    port = await api.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/admin/models/sim/update") as r:
                assert r.status == 409
                assert "nothing was changed" in (await r.json())["error"]
    finally:
        await api.stop()


async def test_a_front_end_without_the_lease_changes_nothing() -> None:
    registry = ModelRegistry()
    registry.add(runtime(1))  # type: ignore[arg-type]
    host, launcher = Host(registry), Launcher()

    def gate() -> None:
        raise ClusterUnavailable("this front end does not hold the lease of the server's decisions now")

    fleet = FleetControl(registry, launcher, host, WorkerDirectory(FakeClock()), gate=gate)  # type: ignore[arg-type]
    with pytest.raises(ClusterUnavailable):
        await fleet.rolling_update("sim", 1)
    with pytest.raises(ClusterUnavailable):
        await fleet.scale_to("sim", 3)
    assert launcher.added == [] and registry.versions("sim") == [1]


async def test_the_admin_api_answers_a_change_without_the_store_with_503_and_retry_after() -> None:
    async def refused(model: str, workers: int, version: int | None = None) -> int:
        raise ClusterUnavailable("the cluster store does not answer: changes are refused until it does")

    api = AdminApi(SimpleNamespace(fleet=SimpleNamespace(scale_to=refused), decider=None), None)  # type: ignore[arg-type]
    port = await api.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/admin/models/sim/scale?workers=2") as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert "the cluster store does not answer" in (await r.json())["error"]
    finally:
        await api.stop()


async def test_a_change_asked_of_a_front_end_that_does_not_decide_is_carried_out_by_the_one_that_does() -> None:
    scaled: list[str] = []

    def fleet(name: str) -> SimpleNamespace:
        async def scale_to(model: str, workers: int, version: int | None = None) -> int:
            scaled.append(name)
            return workers

        return SimpleNamespace(scale_to=scale_to)

    ports: dict[str, int] = {}

    async def holder_is_other(of: str) -> str:  # each names the other: a forwarded change stops there
        return f"127.0.0.1:{ports['holder' if of == 'other' else 'other']}"

    apis = {
        name: AdminApi(SimpleNamespace(fleet=fleet(name), decider=lambda n=name: holder_is_other(n)), "t")  # type: ignore[arg-type]
        for name in ("holder", "other")
    }
    for name, api in apis.items():
        ports[name] = await api.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer t"}) as http:
            async with http.post(f"http://127.0.0.1:{ports['other']}/admin/models/sim/scale?workers=3") as r:
                assert r.status == 200 and await r.json() == {"model": "sim", "workers": 3}
        assert scaled == ["holder"]
    finally:
        for api in apis.values():
            await api.stop()


async def test_a_holder_whose_lease_lapses_mid_update_stops_at_the_next_step() -> None:
    """The gate is asked before each worker step, not only when the update starts: a holder that lost
    the lease meanwhile starts no more workers, and a new version never made the default is dropped."""
    registry = ModelRegistry()
    registry.add(runtime(1))  # type: ignore[arg-type]
    host, launcher = Host(registry), Launcher()
    asked = 0

    def gate() -> None:
        nonlocal asked
        asked += 1
        if asked > 1:  # the lease lapsed once the update had started
            raise ClusterUnavailable("this front end does not hold the lease of the server's decisions now")

    fleet = FleetControl(
        registry,
        launcher,  # type: ignore[arg-type]
        host,  # type: ignore[arg-type]
        WorkerDirectory(FakeClock()),
        load_version=lambda model, version: SimpleNamespace(name=model, version=2, kind="batch", pool=None),  # type: ignore[arg-type,return-value]
        gate=gate,
    )
    with pytest.raises(ClusterUnavailable):
        await fleet.rolling_update("sim")
    assert launcher.added == [] and host.removed == [2]
    assert registry.versions("sim") == [1] and registry.default_version("sim") == 1 and fleet.updates() == {}


def test_a_version_retired_by_the_server_takes_this_front_ends_local_workers_to_the_default() -> None:
    """A front end that did not roll the update (the holder did): its local slots of the retired version
    are retired (not restarted once their workers exit) and as many start at the default version."""
    from inferd.worker.launcher import Launcher as RealLauncher
    from inferd.worker.launcher import WorkerBootstrap, WorkerExit

    class Slots(RealLauncher):  # type: ignore[type-arg]
        async def _start(self, slot: object, bootstrap: WorkerBootstrap) -> object:
            raise AssertionError("not running")

        async def _wait(self, slot: object, process: object) -> WorkerExit:
            raise AssertionError("not running")

        async def stop_all(self, grace_s: float = 5.0) -> None:
            pass

    registry = ModelRegistry()
    registry.add(runtime(2))  # type: ignore[arg-type]
    launcher = Slots("unix:/w", "t", "INFO")
    old = launcher.add("sim", 2, 1)
    fleet = FleetControl(registry, launcher, Host(registry), WorkerDirectory(FakeClock()))  # type: ignore[arg-type]
    assert fleet.move_slots("sim", 1, 2) == 2
    assert all(s.retired for s in old) and launcher.live_slots("sim", 1) == []
    assert [s.version for s in launcher.live_slots("sim")] == [2, 2]
    assert fleet.move_slots("sim", 1, 2) == 0  # none left there: nothing moves


async def test_an_update_without_local_old_workers_waits_for_the_front_ends_to_move_before_it_retires() -> None:
    """The old version's workers are all on other hosts (none here to replace): its one new worker
    ready, the update still waits until the front ends send new requests to the new version (and the old
    holds no work) before the old version goes."""
    registry = ModelRegistry()
    registry.add(runtime(1))  # type: ignore[arg-type]
    host, said = Host(registry), []

    class NoSlots:
        def live_slots(self, model: str, version: int) -> list[SimpleNamespace]:
            return []

        def add(self, model: str, n: int, version: int) -> list[SimpleNamespace]:
            return [SimpleNamespace(worker_id="sim-0")]

    class Moving:
        async def until_serving(self, model: str, version: int) -> None:
            said.append(f"serving {version}")

        async def until_moved(self, model: str, old: int, new: int) -> None:
            said.append(f"moved {old}->{new} (default {registry.default_version(model)}, removed {host.removed})")

    fleet = FleetControl(
        registry, NoSlots(), host, WorkerDirectory(FakeClock()),  # type: ignore[arg-type]
        load_version=lambda model, version: SimpleNamespace(name=model, version=2, kind="batch", pool=None),  # type: ignore[arg-type,return-value]
        followers=Moving(),
    )

    async def ready(rt: object, slot: object) -> None:
        said.append("new worker ready")

    async def idle(rt: object, poll_s: float = 0.05) -> None:
        said.append("old idle")

    fleet._wait_ready, fleet._wait_idle = ready, idle  # type: ignore[method-assign]
    assert await fleet.rolling_update("sim") == {"model": "sim", "from": 1, "to": 2, "replaced": 0}
    assert said == ["serving 2", "new worker ready", "moved 1->2 (default 2, removed [])", "old idle"]
    assert host.removed == [1] and registry.versions("sim") == [2]
