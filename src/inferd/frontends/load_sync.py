"""The whole server's load for the owner's autoscaler and admin API, whichever front end requests reach.

Every REPORT_INTERVAL_S, each follower measures every batch model version it serves (queued items,
arrival rate, its share of the devices' busy time: runtime/frontend_load.py `ModelLoad`) and sends them
to the owner over the plan's owner channel (frontends/owner_channel.py). The owner keeps each
follower's latest report (`FrontendLoads`) and adds the fresh ones to its own load when its autoscaler
observes a model and when /admin/models shows one.
A follower that stops reporting (dead, restarting, or its owner away) stops counting once its last
report expires.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgspec

from inferd.clock import Clock
from inferd.frontends.owner_channel import OwnerChannel, OwnerUnreachable
from inferd.frontends.plan import FrontendPlan
from inferd.runtime.frontend_load import REPORT_INTERVAL_S, ArrivalMeter, FrontendLoads, ModelLoad, model_load
from inferd.runtime.kinds import KindRegistry
from inferd.runtime.registry import ModelRegistry

log = logging.getLogger("inferd.frontends")

REPORT_TIMEOUT_S = 2.0
KIND = "load"


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A follower's batch model versions' loads, as it measured them over its last interval."""

    frontend: int
    loads: list[ModelLoad]


class LoadSync:
    def __init__(
        self,
        plan: FrontendPlan,
        registry: ModelRegistry,
        kinds: KindRegistry,
        clock: Clock,
        channel: OwnerChannel | None = None,
        interval_s: float = REPORT_INTERVAL_S,
    ) -> None:
        self.plan = plan
        self.registry = registry
        self.kinds = kinds
        self.clock = clock
        self.channel = channel or OwnerChannel(plan)
        """The way to the owner (shared with the front end's other exchanges with it)."""
        self.interval_s = interval_s
        self.loads = FrontendLoads(clock) if plan.is_owner else None
        """The owner's: the followers' latest reports."""
        self._meters: dict[tuple[str, int], ArrivalMeter] = {}
        self._failing = False
        if plan.is_owner:
            self.channel.handle(KIND, self._record, REPORT_TIMEOUT_S)

    async def run(self) -> None:
        """Until cancelled: a follower reports every interval (the owner only listens)."""
        if self.plan.is_owner:
            return
        while True:
            await asyncio.sleep(self.interval_s)
            await self.report()

    # ---- follower -----------------------------------------------------------------------------------
    def measure(self) -> LoadReport:
        """This front end's load now: every version it serves of a kind that queues in each front end
        (`Kind.queues_per_frontend`: batch)."""
        loads = []
        for rt in self.registry:
            if not self.kinds.get(rt.kind).queues_per_frontend:
                continue
            stats = rt.statistics()
            meter = self._meters.setdefault((stats.name, stats.version), ArrivalMeter(self.clock))
            loads.append(model_load(stats, meter.rate(stats.version, stats.detail.enqueued_total)))
        served = {(rt.name, rt.version) for rt in self.registry}
        for key in set(self._meters) - served:  # a version removed by a rolling update
            del self._meters[key]
        return LoadReport(self.plan.index, loads)

    async def report(self) -> bool:
        """Send this front end's load to the owner; False when the owner did not take it."""
        sent = msgspec.json.encode(self.measure())
        try:
            await self.channel.ask(KIND, sent, REPORT_TIMEOUT_S)
        except OwnerUnreachable as exc:
            if not self._failing:
                log.warning("load: the owner front end did not take this one's load report (%s)", exc)
            self._failing = True
            return False
        if self._failing:
            log.info("load: the owner front end takes load reports again")
        self._failing = False
        return True

    # ---- owner --------------------------------------------------------------------------------------
    async def _record(self, payload: bytes) -> bytes:
        report = msgspec.json.decode(payload, type=LoadReport)
        if self.loads is not None:
            self.loads.record(report.frontend, report.loads)
        return b"ok"
