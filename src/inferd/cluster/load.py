"""The whole server's load for the autoscaler and the admin API of the front end that decides,
whichever front end requests reach.

Every REPORT_INTERVAL_S, each front end measures every batch model version it serves (queued items,
arrival rate, its share of the devices' busy time: runtime/frontend_load.py `ModelLoad`) and writes them
to its `load/<frontend>` document (ttl EXPIRE_AFTER_S: a front end that stops writing, dead or cut from
the store, stops counting). The front end that runs the autoscaler and the admin API reads the others'
documents every interval and keeps each one's latest (`FrontendLoads`), which it adds to its own load
when its autoscaler observes a model and when /admin/models shows one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from inferd.clock import Clock
from inferd.cluster.reports import Reports
from inferd.cluster.store import Store, StoreError
from inferd.runtime.frontend_load import (
    EXPIRE_AFTER_S,
    REPORT_INTERVAL_S,
    ArrivalMeter,
    FrontendLoads,
    ModelLoad,
    model_load,
)
from inferd.runtime.kinds import KindRegistry
from inferd.runtime.registry import ModelRegistry

log = logging.getLogger("inferd.cluster")

LOAD = "load/"


class LoadReport(msgspec.Struct, frozen=True):
    """A front end's batch model versions' loads, as it measured them over its last interval."""

    frontend: str
    index: int = -1
    loads: list[ModelLoad] = []

    @property
    def name(self) -> int | str:
        return self.index if self.index >= 0 else self.frontend



class LoadReports:
    def __init__(
        self,
        store: Store,
        me: str,
        registry: ModelRegistry,
        kinds: KindRegistry,
        clock: Clock,
        index: int = -1,
        reads: bool = False,
        interval_s: float = REPORT_INTERVAL_S,
    ) -> None:
        self.store = store
        self.reports = Reports(store, LOAD, LoadReport, me, EXPIRE_AFTER_S)
        """Each front end's `load/<frontend>` report (cluster/reports.py)."""
        self.me = me
        self.index = index
        self.registry = registry
        self.kinds = kinds
        self.clock = clock
        self.interval_s = interval_s
        self.loads = FrontendLoads(clock) if reads else None
        """(The front end with the autoscaler and the admin API) the others' latest reports."""
        self._meters: dict[tuple[str, int], ArrivalMeter] = {}
        self._seen: dict[str, int] = {}
        """Each other front end -> the revision of its report recorded (a report is recorded once)."""
        self._failing = False

    async def run(self) -> None:
        """Until cancelled: write this front end's load, and read the others', every interval."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.report()
            with contextlib.suppress(StoreError):
                await self.collect()

    def measure(self) -> LoadReport:
        """This front end's load now: every version it serves of a kind that queues in each front end
        (`Kind.queues_per_frontend`: batch), and of every other kind that scales (llm) its queued work
        alone (an LLM model's sequences held while it has no worker: kinds/llm/cold.py)."""
        loads = []
        for rt in self.registry:
            kind = self.kinds.get(rt.kind)
            if not kind.queues_per_frontend:
                if kind.autoscaling is not None:
                    stats = rt.statistics()
                    loads.append(ModelLoad(stats.name, stats.version, stats.queued))
                continue
            stats = rt.statistics()
            meter = self._meters.setdefault((stats.name, stats.version), ArrivalMeter(self.clock))
            loads.append(model_load(stats, meter.rate(stats.version, stats.detail.enqueued_total)))
        served = {(rt.name, rt.version) for rt in self.registry}
        for key in set(self._meters) - served:  # a version removed by a rolling update
            del self._meters[key]
        return LoadReport(self.me, self.index, loads)

    async def report(self) -> bool:
        """Write this front end's load; False when the store did not take it."""
        try:
            await self.reports.publish(self.measure())
        except StoreError as exc:
            if not self._failing:
                log.warning("load: the cluster store did not take this front end's load (%s)", exc)
            self._failing = True
            return False
        if self._failing:
            log.info("load: the cluster store takes this front end's load again")
        self._failing = False
        return True

    async def collect(self) -> None:
        """Record the others' reports written since the last look (StoreError: none recorded)."""
        if self.loads is None:
            return
        found = await self.reports.others()
        for frontend, (revision, report) in found.items():
            if self._seen.get(frontend) == revision:
                continue
            self._seen[frontend] = revision
            self.loads.record(report.name, report.loads)
        for frontend in set(self._seen) - set(found):
            del self._seen[frontend]
