"""The whole server's load with several front ends (runtime/frontend_load.py, cluster/load.py): the
front end that decides adds the others' fresh reports to its own load, drops stale ones, and its
autoscaler observes the sum; a front end's report reaches it through the cluster store."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from inferd.clock import FakeClock
from inferd.cluster.load import LoadReports
from inferd.cluster.memory import MemoryStore
from inferd.cluster.store import StoreUnavailable
from inferd.fleet.autoscaler import AutoscalerConfig
from inferd.fleet.scaling import ScalingLoop, scaling_policy
from inferd.kinds.batch.demand import Observation
from inferd.kinds.builtin import builtin_kinds
from inferd.runtime.contract import RuntimeStatistics
from inferd.runtime.frontend_load import EXPIRE_AFTER_S, ArrivalMeter, FrontendLoads, ModelLoad
from inferd.runtime.registry import ModelRegistry


def test_the_owner_adds_every_fresh_report_of_the_same_model_version_to_its_own() -> None:
    clock = FakeClock()
    loads = FrontendLoads(clock)
    own = ModelLoad("m", 1, queued_items=3, arrival_rate_items_s=100.0, busy_ratio=0.25)
    loads.record(1, [ModelLoad("m", 1, 4, 120.0, 0.3), ModelLoad("m", 2, 50, 900.0, 0.9)])
    loads.record(2, [ModelLoad("m", 1, 1, 80.0, 0.2), ModelLoad("other", 1, 50, 900.0, 0.9)])
    assert loads.total(own) == ModelLoad("m", 1, 8, 300.0, pytest.approx(0.75))
    assert loads.reporting() == [1, 2]


def test_a_report_replaces_the_previous_one_of_its_front_end() -> None:
    clock = FakeClock()
    loads = FrontendLoads(clock)
    loads.record(1, [ModelLoad("m", 1, 4, 120.0, 0.3)])
    clock.advance(1.0)
    loads.record(1, [ModelLoad("m", 1, 0, 10.0, 0.1)])
    assert loads.total(ModelLoad("m", 1)) == ModelLoad("m", 1, 0, 10.0, 0.1)


def test_a_front_end_that_stops_reporting_stops_counting_once_its_report_expires() -> None:
    clock = FakeClock()
    loads = FrontendLoads(clock)
    own = ModelLoad("m", 1, 2, 50.0, 0.2)
    loads.record(1, [ModelLoad("m", 1, 4, 120.0, 0.3)])
    loads.record(2, [ModelLoad("m", 1, 1, 80.0, 0.2)])
    clock.advance(EXPIRE_AFTER_S - 1.0)
    loads.record(2, [ModelLoad("m", 1, 1, 80.0, 0.2)])  # front end 1 died; 2 goes on
    clock.advance(0.9)
    assert loads.total(own).arrival_rate_items_s == 250.0  # 1's last report still counts
    clock.advance(0.2)
    assert loads.total(own) == ModelLoad("m", 1, 3, 130.0, pytest.approx(0.4))
    assert loads.reporting() == [2]
    clock.advance(EXPIRE_AFTER_S)
    assert loads.total(own) == own and loads.reporting() == []


def test_the_devices_busy_ratio_is_capped_at_one() -> None:
    loads = FrontendLoads(FakeClock())
    loads.record(1, [ModelLoad("m", 1, 0, 0.0, 0.7)])
    assert loads.total(ModelLoad("m", 1, 0, 0.0, 0.6)).busy_ratio == 1.0


def test_the_arrival_meter_measures_since_its_last_look_and_restarts_with_a_version() -> None:
    clock = FakeClock()
    meter = ArrivalMeter(clock)
    assert meter.rate(1, 500) == 0.0  # the first look has nothing to compare with
    clock.advance(2.0)
    assert meter.rate(1, 700) == 100.0
    clock.advance(1.0)
    assert meter.rate(2, 10) == 0.0  # a new version counts from zero
    clock.advance(1.0)
    assert meter.rate(2, 60) == 50.0


# ---- the owner's autoscaler observes the whole server ------------------------------------------------
@dataclass
class Batch:
    """A batch runtime as the scaling loop reads it: its snapshot."""

    name: str = "m"
    version: int = 1
    kind: str = "batch"
    queued: int = 0
    enqueued_total: int = 0
    busy_ratio: float = 0.0
    config: Any = field(default_factory=lambda: SimpleNamespace(default_version=None))

    def statistics(self) -> RuntimeStatistics:
        detail = SimpleNamespace(
            enqueued_total=self.enqueued_total,
            busy_ratio=self.busy_ratio,
            full_batch_latency_s=None,
            max_batch_size=8,
            batch_latency_s=0.1,
            items_per_batch=8.0,
        )
        return RuntimeStatistics(self.name, self.version, "batch", True, (), 1, self.queued, 0, detail)


class Fleet:
    def local_workers(self, model: str, version: int | None = None) -> int:
        return 0


def owner_loop(clock: FakeClock, rt: Batch, others: FrontendLoads | None) -> ScalingLoop:
    registry = ModelRegistry()
    registry.add(rt)  # type: ignore[arg-type]
    config = AutoscalerConfig(min_workers=1, max_workers=4)
    policy = scaling_policy(builtin_kinds().get(rt.kind), config, clock)
    return ScalingLoop(registry, Fleet(), clock, "m", policy, others=others)  # type: ignore[arg-type]


def test_the_owners_autoscaler_observes_its_own_load_plus_the_other_front_ends() -> None:
    clock = FakeClock()
    loads = FrontendLoads(clock)
    rt = Batch(queued=2, enqueued_total=1000, busy_ratio=0.27)
    loop = owner_loop(clock, rt, loads)
    loop.observe()
    clock.advance(1.0)
    rt.enqueued_total = 1200  # 200 items/s here...
    loads.record(1, [ModelLoad("m", 1, 3, 190.0, 0.26)])  # ...and 190 on front end 1
    obs = loop.observe()
    assert isinstance(obs, Observation)
    assert obs.arrival_rate_items_s == pytest.approx(390.0)
    assert obs.busy_ratio == pytest.approx(0.53)
    assert obs.queue_depth_items == 5
    clock.advance(EXPIRE_AFTER_S + 0.1)  # front end 1 is gone
    rt.enqueued_total += int(200 * (EXPIRE_AFTER_S + 0.1))
    obs = loop.observe()
    assert isinstance(obs, Observation)
    assert obs.arrival_rate_items_s == pytest.approx(200.0, rel=0.01)
    assert obs.busy_ratio == pytest.approx(0.27) and obs.queue_depth_items == 2


def test_the_admin_report_shows_what_the_autoscaler_observed() -> None:
    clock = FakeClock()
    loads = FrontendLoads(clock)
    loads.record(1, [ModelLoad("m", 1, 3, 190.0, 0.26)])
    loop = owner_loop(clock, Batch(queued=2, busy_ratio=0.27), loads)
    assert loop.report()["observed"] is None
    loop.observed = loop.observe()
    assert loop.report()["observed"] == {"queued_items": 5, "arrival_rate_items_s": 190.0, "busy_ratio": 0.53}


# ---- through the cluster store ----------------------------------------------------------------------
def serving(*runtimes: Any) -> ModelRegistry:
    registry = ModelRegistry()
    for rt in runtimes:
        registry.add(rt)
    return registry


async def test_a_front_ends_load_reaches_the_one_that_decides_through_the_store() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    mine = Batch(queued=1, enqueued_total=0, busy_ratio=0.1)
    theirs = Batch(queued=4, enqueued_total=0, busy_ratio=0.3)
    owner = LoadReports(store, "0", serving(mine), builtin_kinds(), clock, index=0, reads=True)
    other = LoadReports(store, "1", serving(theirs), builtin_kinds(), clock, index=1)
    assert owner.loads is not None and other.loads is None
    await owner.collect()
    assert owner.loads.reporting() == []  # nobody reported yet
    assert await other.report() is True  # its meter's first look
    clock.advance(1.0)
    theirs.enqueued_total = 150  # 150 items in the second since its last report
    assert await other.report() is True
    assert await owner.report() is True  # its own is not recorded as another's
    await owner.collect()
    assert owner.loads.reporting() == [1]
    whole = owner.loads.total(ModelLoad("m", 1, 1, 100.0, 0.1))
    assert whole == ModelLoad("m", 1, 5, 250.0, pytest.approx(0.4))
    clock.advance(EXPIRE_AFTER_S + 0.1)  # front end 1 stopped writing: its document expired
    await owner.collect()
    assert owner.loads.reporting() == []


async def test_a_load_report_the_store_does_not_take_is_said_and_the_next_one_goes() -> None:
    clock = FakeClock()
    other = LoadReports(Down(), "1", serving(Batch()), builtin_kinds(), clock, index=1)
    assert await other.report() is False


class Down:
    """A store that does not answer."""

    async def write(self, *args: object, **kwargs: object) -> int:
        raise StoreUnavailable("down")
