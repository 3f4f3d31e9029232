"""What a front end tells a shared worker about its queue (protocol.Demand), so the worker's free batch
slots go where the oldest work waits (worker/credits.py decides), and what it gives back unused.

Only workers that grant credits and serve other front ends too (`shared`) are told; a worker serving
this front end alone grants it every free slot unasked. The rules, per such worker, after each
dispatch pass:

* queue empty: give back every slot held (another front end may need it), and say so once;
* items queued, no slot held, not reported since the last batch sent there: report them (once: the
  worker ages the report with its own clock);
* items queued and more than one slot held: keep one, give back the rest.
"""

from __future__ import annotations

from collections.abc import Iterable

from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection, WorkerState


def report_demand(workers: Iterable[WorkerConnection], queued: int, oldest_age_s: float) -> None:
    for w in workers:
        if w.credits is None or not w.shared or w.state is not WorkerState.READY:
            continue
        if queued <= 0:
            if w.credits > 0 or w.demand_sent > 0:
                w.send(p.Demand(0, 0.0, returned=w.credits))
                w.credits = w.demand_sent = 0
        elif w.credits > 1:
            w.send(p.Demand(queued, oldest_age_s, returned=w.credits - 1))
            w.credits, w.demand_sent = 1, queued
        elif w.credits == 0 and w.demand_sent == 0:
            w.send(p.Demand(queued, oldest_age_s))
            w.demand_sent = queued
