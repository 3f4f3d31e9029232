"""Every front end of one server serves the same search indexes, through the shared store
(cluster/store.py): the search kind's own documents, which the store knows only as names and bytes.

An index created or deleted through the API is created or deleted by the holder of the `decider` lease
(cluster/lease.py), wherever it runs (another front end forwards the PUT or DELETE to it,
frontends/search_writes.py). Two kinds of document:
- `kind/search/indexes` (`IndexesDoc`): the indexes of the whole server and their settings, one document
  for every front end on every host. Written by the lease's holder, fenced with its grant (a deposed
  holder's late write is refused) and compare-and-set on the revision read, on each create and delete,
  and again every interval while it differs from what the holder serves (a write the store refused is
  made again), but only once the holder has applied the document's current revision itself (a front end
  that just took the lease never writes back what it had not caught up with; a create or delete
  catches up before it starts, `catch_up`, so the index it creates is never dropped as one the document
  lacks). Every front end follows it (`Follower`): it serves the indexes it lacks, stops serving the
  ones that are gone (their files in its host's data_dir go too, unless the model repository declares
  them: a log of the old index is never taken for a new one's), and serves again (anew) one whose
  settings differ (deleted and created again); a front end that runs local workers (the first of its
  host) starts its share of an index's replica workers there too, and retires them when the index goes. A document never written changes nothing: a front end serves data_dir's indexes until
  the holder's come.
- `kind/search/serving/<frontend>` (`ServingDoc`, expiring after REPORT_TTL_S): the indexes that front
  end serves, written once it applied the document and at least every REPORT_TTL_S / 3. The holder
  reads them with `read_prefix`: it starts a new index's replica workers only once every front end that
  reported lately serves the index too (at most FOLLOWERS_WAIT_S), because a worker joins every front end
  and a front end that does not know its index would turn it away for good; and a delete answers once
  those front ends no longer serve the index (as long at most), so that an index created again under its
  name is never taken for the old one (its replicas, seqs and cached results). A front end that is down
  meanwhile (its report expired) is not waited for: it serves the server's indexes when it starts again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from inferd.clock import Clock
from inferd.cluster.follower import Document, Follower
from inferd.cluster.reports import Reports
from inferd.cluster.store import Grant, Store, StoreError, Versioned
from inferd.config import ModelConfig
from inferd.errors import ClusterUnavailable, NotFound
from inferd.kinds.search.config import index_config, params_of, parse_params
from inferd.kinds.search.kind import API
from inferd.kinds.search.store import SETTINGS_FILE, IndexStore

log = logging.getLogger("inferd.search")

INDEXES = "kind/search/indexes"
SERVING_PREFIX = "kind/search/serving/"
SHARE_INTERVAL_S = 0.25
"""How often the holder checks the document, and a front end its report."""
REPORT_TTL_S = 2.0
"""A front end whose report is older than this is down: the holder does not wait for it."""
CONFIRM_EVERY_S = 5.0
"""The holder reads the document again this often even when its indexes did not change (a store that
lost it gets it again)."""
FOLLOWERS_WAIT_S = 5.0


class IndexesDoc(msgspec.Struct, frozen=True):
    """The server's indexes and their settings (written by the `decider` lease's holder)."""

    settings: dict[str, dict[str, Any]] = {}


class ServingDoc(msgspec.Struct, frozen=True):
    """A front end's: the indexes it serves."""

    serving: list[str] = []


INDEXES_DOC = Document(INDEXES, IndexesDoc, IndexesDoc)
SERVING_DOC = Document(SERVING_PREFIX, ServingDoc, ServingDoc)
"""A report's codec, as cluster/reports.py writes it (each front end's is named SERVING_PREFIX + its id)."""


class SharedIndexes:
    def __init__(
        self,
        store: Store,
        follower: Follower,
        server: Any,
        frontend: str,
        holding: Callable[[], Grant | None],
        clock: Clock,
        interval_s: float = SHARE_INTERVAL_S,
        supervises: bool = False,
    ) -> None:
        self.store = store
        self.doc = INDEXES_DOC
        self.reports_of = Reports(store, SERVING_PREFIX, ServingDoc, frontend, REPORT_TTL_S)
        """Each front end's `kind/search/serving/<frontend>` report (cluster/reports.py)."""
        self.server = server
        """The composition root: its registry, kinds, add_version, remove_version and supervisor."""
        self.frontend = frontend
        self.holding = holding
        """The grant of the `decider` lease while this front end acts as its holder (cluster/lease.py's
        LeaseKeeper.grant); None otherwise."""
        self.supervises = supervises
        """This front end runs its host's local workers: it starts and retires an index's there."""
        self.clock = clock
        self.interval_s = interval_s
        self.applied: tuple[int, bytes] | None = None
        """The document as last applied (or written) here: (revision, bytes). The bytes too: a store that
        lost its data (a Redis restarted empty) numbers revisions from 1 again."""
        self._published: tuple[float, dict[str, dict[str, Any]]] | None = None
        """(when, what) of the document as last written or found the same."""
        self._reported: tuple[float, list[str]] | None = None
        """(when, what) of this front end's last report that landed."""
        self._added: set[str] = set()
        """The indexes this front end serves because the document has them (`_add`)."""
        self._applying = asyncio.Lock()
        """One application or publication at a time: an older document is never applied after a newer
        one, nor written back."""
        follower.follow(self.doc.name, self._apply)

    @property
    def holds(self) -> bool:
        """This front end holds the lease: it writes the document."""
        return self.holding() is not None

    async def run(self) -> None:
        """Until cancelled: the holder keeps the document true; every front end keeps its report."""
        while True:
            try:
                if self.holds:
                    await self._keep_published()
                await self.report()
            except StoreError as exc:
                log.debug("search indexes: the cluster store refused a write (%s): again shortly", exc)
            await asyncio.sleep(self.interval_s)

    # ---- the holder -----------------------------------------------------------------------------------
    async def publish(self) -> None:
        """Write the indexes served here, when the document says otherwise: only while holding the lease
        (fenced with its grant), and once the document's current revision is applied here."""
        grant = self.holding()
        if grant is None:
            return
        started = self.clock.now()
        async with self._applying:
            await self._catch_up()  # first: what it had not applied is never written back
            settings = self._settings()
            revision, doc = await self.doc.update(
                self.store, lambda doc: None if doc.settings == settings else IndexesDoc(settings), fence=grant
            )
            if revision:
                self.applied = (revision, self.doc.encode(doc))
        self._published = (started, settings)

    async def catch_up(self) -> None:
        """The holder, before it creates or deletes an index: serve the document's current revision
        first. A holder still behind it (it just took the lease) would otherwise drop the index it
        creates when it publishes, as one the document lacks. StoreError when the store does not answer."""
        async with self._applying:
            await self._catch_up()

    async def _catch_up(self) -> None:
        found = await self.store.read(self.doc.name)
        if found is not None and (found.revision, found.body) != self.applied:
            self._take(found)

    async def _keep_published(self) -> None:
        if self._published is not None:
            at, settings = self._published
            if settings == self._settings() and self.clock.now() - at < CONFIRM_EVERY_S:
                return
        await self.publish()

    async def until_followers_serve(self, name: str) -> None:
        """The holder, before it starts a new index's workers: until the front ends up serve it."""
        await self._until(lambda r: name not in r.serving, name, "do not serve it yet")

    async def until_followers_drop(self, name: str) -> None:
        """The holder, once it deleted an index: until the front ends up no longer serve it."""
        await self._until(lambda r: name in r.serving, name, "serve it still")

    async def reports(self) -> dict[str, frozenset[str]]:
        """The indexes each other front end up (its report not expired) serves, by front end."""
        return {f: frozenset(r.serving) for f, (_, r) in (await self.reports_of.others()).items()}

    async def _until(self, lagging: Callable[[ServingDoc], bool], name: str, what: str) -> None:
        """Publish, then wait for the front ends' reports (bounded). StoreError (or Fenced) when the
        document could not be written, ClusterUnavailable when this front end no longer holds the lease:
        the create or delete is not answered done then."""
        if not self.holds:  # lost since the write was routed here: the next holder's document is the word
            raise ClusterUnavailable("this front end no longer decides for the server (its lease lapsed); try again")
        await self.publish()
        try:
            behind = await self.reports_of.until(lagging, FOLLOWERS_WAIT_S)
        except StoreError as exc:
            log.warning("index %s: the front ends' reports could not be read (%s)", name, exc)
            return
        if behind:
            log.warning("index %s: front ends %s %s (timed out)", name, sorted(behind), what)

    def _settings(self) -> dict[str, dict[str, Any]]:
        """The indexes served here and their settings, as the document holds them (msgpack's types)."""
        registry = self.server.registry
        settings = {name: registry.get(name).config.params for name in self._serving()}
        return INDEXES_DOC.decode(Versioned(1, INDEXES_DOC.encode(IndexesDoc(settings))))[1].settings

    # ---- every front end ------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Serve the server's indexes now (a create or delete forwarded to the holder was answered). A
        store that does not answer leaves it to the follow loop: the write's answer is the holder's."""
        try:
            found = await self.store.read(self.doc.name)
        except StoreError as exc:
            log.warning("search indexes: the server's could not be read (%s): served once the store answers", exc)
            return
        await self._apply(found)

    async def report(self, force: bool = False) -> None:
        """Write the indexes served here, when they changed or the last report ages."""
        serving = self._serving()
        now = self.clock.now()
        if not force and self._reported is not None:
            at, reported = self._reported
            if reported == serving and now - at < REPORT_TTL_S / 3:
                return
        await self.reports_of.publish(ServingDoc(serving))
        self._reported = (now, serving)

    async def _apply(self, found: Versioned | None) -> None:
        async with self._applying:
            with contextlib.suppress(StoreError):  # the latest, read under the lock: an older read that
                found = await self.store.read(self.doc.name)  # waited for it is never applied after a newer one
            if found is None or (found.revision, found.body) == self.applied:
                return  # never written (data_dir's indexes stay), or applied already
            self._take(found)
        try:
            await self.report(force=True)  # the holder may be waiting on it
        except StoreError as exc:
            log.debug("search indexes: this front end's report was refused (%s): again shortly", exc)

    def _take(self, found: Versioned) -> None:
        """Serve what `found` (the document) says; under `_applying`."""
        _, doc = self.doc.decode(found)
        self._serve(doc.settings)
        self.applied = (found.revision, found.body)

    def _serve(self, settings: dict[str, dict[str, Any]]) -> None:
        for name in sorted(set(self._serving()) - set(settings)):
            self._drop(name, deleted=True)
        for name in sorted(set(self._serving()) & set(settings)):
            if self._other_settings(name, settings[name]):  # deleted and created again
                self._drop(name)
        for name in sorted(set(settings) - set(self._serving())):
            self._add(name, settings[name])

    def _serving(self) -> list[str]:
        """The served models of the kinds that come in on the search routes (`Kind.api`)."""
        return self.server.registry.names(self.server.kinds.serving(API))

    def _other_settings(self, name: str, settings: dict[str, Any]) -> bool:
        mine = params_of(self.server.registry.get(name).config)
        return mine != parse_params(settings, f"settings of index {name!r}")

    def _add(self, name: str, settings: dict[str, Any]) -> None:
        if name in self.server.registry:  # a declared model of that name wins
            return
        config: ModelConfig = index_config(name, parse_params(settings, f"settings of index {name!r}"))
        self.server.add_version(config)
        self._added.add(name)
        if self.supervises:  # this host's share of its replica workers (they join every front end)
            self.server.supervisor.add(name, config.workers, None)
        log.info("index %s created (by the decider lease's holder): served here too", name)

    def _drop(self, name: str, deleted: bool = False) -> None:
        """Stop serving `name`; `deleted` (the document has it no more): its files in this host's
        data_dir go too, unless the model repository declares it. Its logs there would otherwise be taken
        for the index's by a writer here of one created again under its name (a new index's replicas
        start empty: an own log as far as all of them is the index, kinds/search/takeover.py)."""
        files = IndexStore(self.server.config.data_dir)
        created = name in self._added or (files.folder(name) / SETTINGS_FILE).is_file()  # not declared
        self._added.discard(name)
        rt = self.server.registry.get(name)
        if self.supervises:
            supervisor = self.server.supervisor
            for slot in supervisor.live_slots(name):
                supervisor.retire(slot)
                supervisor.kill(slot.incarnation)
        self.server.remove_version(name, rt.version, NotFound(f"index {name!r} was deleted"))
        if deleted and created:
            try:
                files.remove(name)
            except OSError as exc:  # (another front end of this host may remove it at once)
                log.warning("index %s: its files in data_dir could not be removed: %s", name, exc)
        log.info("index %s deleted (by the decider lease's holder): no longer served here", name)
