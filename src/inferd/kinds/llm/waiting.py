"""One priority class of an LLM engine's waiting sequences, in admission order. No I/O.

Preempted sequences come first (they were admitted once and are owed their seat back), in the order they
were put back. Then each tenant has its own FIFO lane, and the lanes take turns by weight: the next
admission goes to the tenant `FairOrder` (routing/fairness.py: weighted fair queuing over admissions)
names, and charges it 1 / weight. So a tenant flooding the engine cannot push the others' sequences back:
a light tenant's new sequence is admitted ahead of a heavy tenant's backlog, and under a backlog from
both, admissions converge to their weights. With one tenant (none configured) this is plain FIFO.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from inferd.kinds.llm.sequence import Sequence
from inferd.routing.fairness import FairOrder


class WaitingClass:
    def __init__(self) -> None:
        self._resumed: deque[Sequence] = deque()
        self._lanes: dict[str, deque[Sequence]] = {}
        self._order = FairOrder()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __contains__(self, seq: Sequence) -> bool:
        lane = self._lanes.get(seq.tenant, ())
        return seq in self._resumed or seq in lane

    def add(self, seq: Sequence) -> None:
        """A new sequence joins the tail of its tenant's lane."""
        lane = self._lanes.get(seq.tenant)
        if lane is None:
            lane = self._lanes[seq.tenant] = deque()
            self._order.join(seq.tenant, seq.weight)
        lane.append(seq)
        self._count += 1

    def put_back(self, seq: Sequence) -> None:
        """A preempted sequence goes ahead of every other waiting one."""
        self._resumed.appendleft(seq)
        self._count += 1

    def head(self) -> Sequence | None:
        """The sequence the next admission takes (None: nothing waits)."""
        if self._resumed:
            return self._resumed[0]
        if not self._lanes:
            return None
        return self._lanes[self._order.next()][0]

    def pop(self, seq: Sequence) -> None:
        """`seq`, the head, was admitted: a new sequence charges its tenant's turn."""
        if self._resumed and self._resumed[0] is seq:
            self._resumed.popleft()
            self._count -= 1
            return
        self._order.charge(seq.tenant)
        self._drop(seq)

    def remove(self, seq: Sequence) -> bool:
        """Take out a waiting sequence (aborted): False if it was not waiting here. Not charged."""
        if seq in self._resumed:
            self._resumed.remove(seq)
            self._count -= 1
            return True
        if seq not in self._lanes.get(seq.tenant, ()):
            return False
        self._drop(seq)
        return True

    def _drop(self, seq: Sequence) -> None:
        lane = self._lanes[seq.tenant]
        if lane[0] is seq:
            lane.popleft()
        else:
            lane.remove(seq)
        self._count -= 1
        if not lane:
            del self._lanes[seq.tenant]
            self._order.leave(seq.tenant)

    def in_order(self) -> Iterator[Sequence]:
        """Every waiting sequence in the order admissions would take them if nothing else arrived (a
        simulation on copies of the tenants' virtual times: for inspection, not the hot path)."""
        yield from self._resumed
        weights = self._order.weights()
        passes = {t: self._order.pass_of(t) for t in self._order.tenants()}  # tie-break order kept
        cursors = dict.fromkeys(passes, 0)
        while passes:
            t = min(passes, key=passes.__getitem__)
            yield self._lanes[t][cursors[t]]
            cursors[t] += 1
            passes[t] += 1.0 / weights[t]
            if cursors[t] == len(self._lanes[t]):
                del passes[t]
