"""[slo] shed_lost: with SLO batching, a queued request that can no longer meet latency_ms is answered at
once with 429 (reason slo_lost) instead of waiting for a lull, run through inferd's own runtime and
dispatcher on a virtual clock (the fleet simulator): under a burst the device can only partly serve,
without it late answers pile up; with it every answer is on time and the rest are refused, each request
answered once. The option is refused at start on a model that does not batch by SLO."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from inferd.errors import Overloaded
from inferd.fleetsim.batch_fleet import BatchFleet, FleetSpec
from inferd.fleetsim.profiles import BatchProfile
from inferd.fleetsim.report import Outcome
from inferd.kinds.batch.queue import QueuedItem
from inferd.models.sim import sim_config
from inferd.routing.fairness import BULK
from tests.property.test_slo_runtime import slo_fleet

LATENCY_MS = 100.0
DEVICE = BatchProfile("given", 0.02, 0.0005, overhead_s=0.0, source="given")


def burst(shed: bool) -> tuple[BatchFleet, np.ndarray]:
    """Steady 300 req/s for 2 s (the cost line gets measured), then 2,000 requests at once, then 300 req/s."""
    steady = np.arange(0.0, 4.0, 1 / 300)
    times = np.sort(np.concatenate([steady, np.full(2000, 2.0)]))
    config = sim_config(
        max_batch_size=256,
        max_queue_size=4000,
        batching="slo",
        slo={"latency_ms": LATENCY_MS, "shed_lost": shed},
    )

    async def main() -> BatchFleet:
        fleet = BatchFleet(FleetSpec(config, DEVICE, 1, times, warmup_s=0.0))
        fleet.run()
        return fleet

    return asyncio.run(main()), times


def test_lost_requests_are_refused_at_once_and_the_answers_stay_on_time() -> None:
    kept, times = burst(shed=False)
    late = (kept.done_at - times) > LATENCY_MS / 1000
    assert (kept.outcome == Outcome.OK).all() and late.sum() > 500  # the backlog waited, answered late

    shed, _ = burst(shed=True)
    ok = shed.outcome == Outcome.OK
    refused = shed.outcome == Outcome.REJECTED
    assert (ok | refused).all() and refused.sum() > 500  # each answered once: a result or a 429
    on_time = (shed.done_at[ok] - times[ok]) <= LATENCY_MS / 1000 + 1e-9
    assert on_time.all(), f"{(~on_time).sum()} answers came late"
    assert ok.sum() >= (~late).sum()  # as many answers within the SLO as when the backlog waited


def test_shed_lost_is_refused_on_a_model_that_does_not_batch_by_slo() -> None:
    with pytest.raises(ValueError, match=r'shed_lost .* batching = "slo": set that'):
        sim_config(slo={"latency_ms": 100, "shed_lost": True})
    assert sim_config(batching="slo", slo={"latency_ms": 100, "shed_lost": True}).slo.shed_lost


def test_only_never_sent_interactive_items_are_shed() -> None:
    """A crash's retry or a hedge (sent before: its first batch may still answer) and bulk items (spare
    capacity) are kept; a fresh interactive item past the cutoff gets 429 slo_lost, a newer one stays."""

    async def main() -> dict[str, object]:
        fleet = slo_fleet(max_batch=8, queue_size=64, n_workers=1, shed=True)
        rt, loop = fleet.rt, asyncio.get_running_loop()
        items = {
            "fresh": QueuedItem("fresh", 1.0, None, loop.create_future()),
            "retried": QueuedItem("retried", 1.0, None, loop.create_future(), attempts=1),
            "hedged": QueuedItem("hedged", 1.0, None, loop.create_future(), attempts=1, hedged=True),
            "bulk": QueuedItem("bulk", 1.0, None, loop.create_future(), priority=BULK),
            "newer": QueuedItem("newer", 5.0, None, loop.create_future()),
        }
        for item in items.values():
            rt.queue.push(item)
        rt._dispatcher.policy.lost_before = lambda now: 3.0  # items enqueued before t = 3 s are lost
        rt._dispatcher._shed_lost()
        shed = {k for k, i in items.items() if i.reply.done() and isinstance(i.reply.exception(), Overloaded)}
        assert all(isinstance(items[k].reply.exception(), Overloaded) for k in shed)
        assert items["fresh"].reply.exception().reason == "slo_lost"
        return {"shed": shed, "queued": len(rt.queue)}

    out = asyncio.run(main())
    assert out == {"shed": {"fresh"}, "queued": 4}
