"""One canary decision for the whole server, whichever front end a request goes through, through the
shared store (cluster/store.py).

Every front end runs the same traffic splits (gateway/traffic_control.py), but only the lease holder's
decide: it steps each canary on its clock and judges rollback on the outcomes of every front end
(`Traffic.tick`, `Traffic.absorb`). The others (`Traffic.follower`) neither step nor judge: they keep
the canary and baseline outcomes they see for the judge and apply its states. Who is which follows the
lease (`holding()`, cluster/lease.py) every interval: a front end that becomes the holder first moves its
splits to the `canary` document's states, so a new holder goes on from where the last one was, never
from a canary's first step.

Two kinds of document:
- `canary` (`CanaryDoc`): every canary split's state (`SplitState`, by model) and, for each front end,
  the mark of its last batch of outcomes the judge absorbed. Written by the holder only, fenced with its
  grant and compare-and-set on the revision it read; followed by every front end (`Follower`), which
  moves its splits forward to those states (never back) and forgets the batches marked absorbed.
- `canary-outcomes/<frontend>` (`OutcomesDoc`, expiring after OUTCOMES_TTL_S): the batches of outcomes
  that front end saw and has not yet seen marked absorbed, numbered 1, 2, ... within its incarnation
  (a token drawn at start). Read by the holder with `read_prefix`.

Each outcome is judged once, whatever fails:
- the holder absorbs a batch only when its number is past the front end's mark (of the same
  incarnation), and writes the new marks in the same fenced write as the states; it remembers its own
  marks while it holds the lease, so a write of its that failed absorbs nothing twice;
- a front end's write that fails keeps its batches: they go with its next write;
- a new holder starts from the document's marks: batches a deposed holder absorbed without its write
  landing are judged again by the new judge only (a judge's windows are its own, not in the document);
- the holder drops the marks of front ends without a live outcomes document. A front end whose batches
  were sent but that could not write for OUTCOMES_TTL_S (its document, and so its mark, may be gone)
  drops those batches and takes a new incarnation: they may have been judged already.
Bounded: a front end keeps at most MAX_SAMPLES outcomes pending (the oldest batches go first; the judge
keeps no more either). While no front end holds the lease, every one keeps its state and nobody judges.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

import msgspec

from inferd.clock import Clock
from inferd.cluster.follower import Document, Follower
from inferd.cluster.store import Fenced, Grant, RevisionConflict, Store, StoreError, Versioned
from inferd.gateway.canary_judge import MAX_SAMPLES
from inferd.gateway.traffic import SplitState
from inferd.gateway.traffic_control import Outcomes, Traffic

log = logging.getLogger("inferd.traffic")

CANARY = "canary"
OUTCOMES_PREFIX = "canary-outcomes/"
SHARE_INTERVAL_S = 0.5
"""How often a front end hands over its outcomes, and how often the holder judges and steps."""
OUTCOMES_TTL_S = 30.0
"""A front end's outcomes document expires this long after its last write."""


class Batch(msgspec.Struct, frozen=True):
    """Outcomes one front end saw in one interval, by model, under each split's key."""

    seq: int
    outcomes: dict[str, Outcomes]


class OutcomesDoc(msgspec.Struct, frozen=True):
    incarnation: str = ""
    batches: list[Batch] = []


class Mark(msgspec.Struct, frozen=True):
    """The last batch of one front end's incarnation that the judge absorbed."""

    incarnation: str
    seq: int


class CanaryDoc(msgspec.Struct, frozen=True):
    states: dict[str, SplitState] = {}
    absorbed: dict[str, Mark] = {}


CANARY_DOC = Document(CANARY, CanaryDoc, CanaryDoc)
OUTCOMES_DOC = Document(OUTCOMES_PREFIX, OutcomesDoc, OutcomesDoc)
"""The outcomes' codec (each front end's document is named OUTCOMES_PREFIX + its id)."""


class CanaryShare:
    def __init__(
        self,
        store: Store,
        follower: Follower,
        traffic: Traffic,
        frontend: str,
        holding: Callable[[], Grant | None],
        clock: Clock,
        interval_s: float = SHARE_INTERVAL_S,
    ) -> None:
        self.store = store
        self.traffic = traffic
        self.frontend = frontend
        """This front end's id: its outcomes document's name and its mark's."""
        self.holding = holding
        self.clock = clock
        self.interval_s = interval_s
        self.incarnation = secrets.token_hex(8)
        self.pending: list[Batch] = []
        """This front end's batches not yet seen marked absorbed, oldest first."""
        self._seq = 0
        self._sent_up_to = 0
        """The last batch number a write of this front end's document carried."""
        self._landed_at = clock.now()
        """When the last write of this incarnation that landed started (its start, at first)."""
        self._dirty = False
        self._deposed: tuple[str, int] | None = None
        """(holder, epoch) of a grant the store fenced: over, whatever `holding()` says until it knows."""
        self._judging: tuple[str, int] | None = None
        """(holder, epoch) of the grant under which this front end judges; None: it follows."""
        self._marks: dict[str, Mark] = {}
        """The holder's marks, as absorbed here (ahead of the document's when a write failed)."""
        self._failing = False
        self._stale_states = False
        """The last `canary` read holds states (of splits this front end may no longer run)."""
        self._dropping = False
        follower.follow(CANARY, self._apply)

    async def open(self) -> None:
        """Before this front end listens: the server's canary states (a front end that starts goes on
        from them, not from its config's first step). The store not answering leaves the config's."""
        try:
            self._apply_doc((await CANARY_DOC.read(self.store))[1])
        except StoreError as exc:
            log.warning("traffic: the canary states could not be read (%s): starting from the config's", exc)

    async def run(self) -> None:
        """Until cancelled: hand over outcomes and, on the holder, judge and step, every interval."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except StoreError as exc:
                if not self._failing:
                    log.warning("traffic: the cluster store refused the canary share (%s)", exc)
                self._failing = True
            else:
                if self._failing:
                    log.info("traffic: the canary share goes on")
                self._failing = False

    async def step(self) -> None:
        """One interval: this front end's outcomes to the store, then the holder's judging (also without
        splits while `canary` holds states: a split removed by a reload leaves none behind)."""
        if self.traffic.splits or self.pending:
            await self.hand_over()
        grant = self.holding()
        if grant is None or (grant.holder, grant.epoch) == self._deposed:
            self._follow()
        elif self.traffic.splits or self._stale_states:
            await self.judge(grant)

    # ---- every front end ----------------------------------------------------------------------------
    async def hand_over(self) -> None:
        """Batch the outcomes seen since the last interval and write the batches not marked absorbed."""
        taken = self.traffic.take_outcomes()
        if taken:
            self._seq += 1
            self.pending.append(Batch(self._seq, taken))
            self._dirty = True
            self._bound()
        if not self.pending:
            return
        now = self.clock.now()
        if now - self._landed_at >= OUTCOMES_TTL_S and self.pending[0].seq <= self._sent_up_to:
            self._renew(now)
        if not self._dirty and now - self._landed_at < OUTCOMES_TTL_S / 3:
            return
        body = OUTCOMES_DOC.encode(OutcomesDoc(self.incarnation, list(self.pending)))
        self._sent_up_to = self.pending[-1].seq  # sent once tried: a write that timed out may have landed
        await self.store.write(OUTCOMES_PREFIX + self.frontend, body, ttl_s=OUTCOMES_TTL_S)
        self._landed_at, self._dirty = now, False

    def _bound(self) -> None:
        dropped = 0
        while sum(len(o.outcomes) for b in self.pending for o in b.outcomes.values()) > MAX_SAMPLES:
            self.pending.pop(0)
            dropped += 1
        if dropped and not self._dropping:
            log.warning("traffic: canary outcomes wait for a judge past %d: the oldest are dropped", MAX_SAMPLES)
        self._dropping = bool(dropped)

    def _renew(self, now: float) -> None:
        """Sent batches that may have expired with this front end's document (and its mark) go; the
        others are numbered again under a new incarnation."""
        kept = [b for b in self.pending if b.seq > self._sent_up_to]
        log.warning(
            "traffic: %d batch(es) of canary outcomes could not be handed over for %.0f s: dropped",
            len(self.pending) - len(kept),
            OUTCOMES_TTL_S,
        )
        self.incarnation = secrets.token_hex(8)
        self.pending = [Batch(i + 1, b.outcomes) for i, b in enumerate(kept)]
        self._seq, self._sent_up_to, self._landed_at, self._dirty = len(kept), 0, now, True

    async def _apply(self, found: Versioned | None) -> None:
        self._apply_doc(CANARY_DOC.decode(found)[1])

    def _apply_doc(self, doc: CanaryDoc) -> None:
        """A `canary` document read: its states (the holder's own are ahead of it) and this front end's
        batches it marks absorbed."""
        self._stale_states = bool(doc.states)
        if self._judging is None:
            self.traffic.merge(doc.states)
        mark = doc.absorbed.get(self.frontend)
        if mark is not None and mark.incarnation == self.incarnation:
            self.pending = [b for b in self.pending if b.seq > mark.seq]

    def _follow(self) -> None:
        if self._judging is not None:
            log.info("traffic: this front end no longer holds the lease: it follows the canary decisions")
        self._judging = None
        self.traffic.follower = True

    # ---- the holder ---------------------------------------------------------------------------------
    async def judge(self, grant: Grant) -> None:
        """Absorb every front end's new batches, step and judge, and write the states and marks."""
        found = await self.store.read(CANARY)
        revision, doc = CANARY_DOC.decode(found)
        if self._judging != (grant.holder, grant.epoch):
            self.traffic.merge(doc.states)  # go on from the last holder's state
            self._marks = dict(doc.absorbed)
            self._judging = (grant.holder, grant.epoch)
            self.traffic.follower = False
            log.info("traffic: this front end holds the lease (epoch %d): it judges the canaries", grant.epoch)
        self._absorb(await self.store.read_prefix(OUTCOMES_PREFIX))
        self.traffic.tick()
        written = CanaryDoc(self.traffic.shared(), dict(self._marks))
        self._stale_states = bool(doc.states)
        if written == doc:
            return
        try:
            await self.store.write(CANARY, CANARY_DOC.encode(written), expect=revision, fence=grant)
            self._stale_states = bool(written.states)
        except Fenced:
            self._deposed = (grant.holder, grant.epoch)
            self._follow()
            raise
        except RevisionConflict:
            log.debug("traffic: the canary document moved since it was read: written next interval")

    def _absorb(self, docs: dict[str, Versioned]) -> None:
        marks: dict[str, Mark] = {}
        for name, found in docs.items():
            frontend = name[len(OUTCOMES_PREFIX) :]
            _, sent = OUTCOMES_DOC.decode(found)
            mark = self._marks.get(frontend)
            after = mark.seq if mark is not None and mark.incarnation == sent.incarnation else 0
            for batch in sent.batches:
                if batch.seq > after:
                    self.traffic.absorb(batch.outcomes)
            marks[frontend] = Mark(sent.incarnation, max([after, *(b.seq for b in sent.batches)]))
        self._marks = marks
