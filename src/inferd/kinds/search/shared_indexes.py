"""Every front end of one server serves the same search indexes, through the shared store
(cluster/store.py): the search kind's own documents, which the store knows only as names and bytes.

An index created or deleted through the API is created or deleted by the index owner, the front end
that writes the shard logs (front end 0 of `--frontends N`; another front end forwards the PUT or
DELETE, frontends/search_writes.py). Two kinds of document:
- `kind/search/indexes` (`IndexesDoc`): the indexes the owner serves and their settings. Written by the
  owner, compare-and-set on the revision it read (not fenced by the lease: the owner is the front end
  that holds the logs, whoever holds the lease), on each create and delete and again every interval
  while it differs from what the owner serves (a write the store refused is made again). Every other
  front end follows it (`Follower`): it serves the indexes it lacks, stops serving the ones that are
  gone, and serves again (anew) one whose settings differ (deleted and created again). A document
  never written changes nothing: a front end serves data_dir's indexes until the owner's come.
- `kind/search/serving/<frontend>` (`ServingDoc`, expiring after REPORT_TTL_S): the indexes that front
  end serves, written once it applied the owner's document and at least every REPORT_TTL_S / 3. The owner
  reads them with `read_prefix`: it starts a new index's replica workers only once every front end that
  reported lately serves the index too (at most FOLLOWERS_WAIT_S), because a worker joins every front end
  and a front end that does not know its index would turn it away for good; and a delete answers once
  those front ends no longer serve the index (as long at most), so that an index created again under its
  name is never taken for the old one (its replicas, seqs and cached results). A front end that is down
  meanwhile (its report expired) is not waited for: it serves the owner's indexes when it starts again.
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
from inferd.cluster.store import Store, StoreError, Versioned
from inferd.config import ModelConfig
from inferd.errors import NotFound
from inferd.kinds.search.config import index_config, params_of, parse_params
from inferd.kinds.search.kind import API

log = logging.getLogger("inferd.search")

INDEXES = "kind/search/indexes"
SERVING_PREFIX = "kind/search/serving/"
SHARE_INTERVAL_S = 0.25
"""How often the owner checks its document, and a front end its report."""
REPORT_TTL_S = 2.0
"""A front end whose report is older than this is down: the owner does not wait for it."""
CONFIRM_EVERY_S = 5.0
"""The owner reads its document again this often even when its indexes did not change (a store that
lost it gets it again)."""
FOLLOWERS_WAIT_S = 5.0


class IndexesDoc(msgspec.Struct, frozen=True):
    """The owner's: the indexes it serves and their settings."""

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
        owner: bool,
        clock: Clock,
        interval_s: float = SHARE_INTERVAL_S,
        scope: str = "",
    ) -> None:
        self.store = store
        self.doc = INDEXES_DOC if not scope else Document(f"{INDEXES}/{scope}", IndexesDoc, IndexesDoc)
        """The owner's document: `scope` names the group of front ends of one owner (the `--frontends N` of
        one host), so that owners on several hosts sharing one store each keep their own."""
        prefix = SERVING_PREFIX if not scope else f"{SERVING_PREFIX}{scope}/"
        self.reports_of = Reports(store, prefix, ServingDoc, frontend, REPORT_TTL_S)
        """Each front end's `kind/search/serving/<frontend>` report (cluster/reports.py)."""
        self.server = server
        """The composition root: its registry, kinds, add_version and remove_version."""
        self.frontend = frontend
        self.owner = owner
        """This front end writes the shard logs: its indexes are the server's."""
        self.clock = clock
        self.interval_s = interval_s
        self.applied: tuple[int, bytes] | None = None
        """The owner's document as last applied here: (revision, bytes). The bytes too: a store that lost
        its data (a Redis restarted empty) numbers revisions from 1 again."""
        self._published: tuple[float, dict[str, dict[str, Any]]] | None = None
        """(when, what) of the owner's document as last written or found the same."""
        self._reported: tuple[float, list[str]] | None = None
        """(when, what) of this front end's last report that landed."""
        self._applying = asyncio.Lock()
        """One application at a time: an older document is never applied after a newer one."""
        if not owner:
            follower.follow(self.doc.name, self._apply)

    async def run(self) -> None:
        """Until cancelled: the owner keeps its document true, another front end its report."""
        while True:
            try:
                if self.owner:
                    await self._keep_published()
                else:
                    await self.report()
            except StoreError as exc:
                log.debug("search indexes: the cluster store refused a write (%s): again shortly", exc)
            await asyncio.sleep(self.interval_s)

    # ---- the owner ----------------------------------------------------------------------------------
    async def publish(self) -> None:
        """Write the indexes served here, when the document says otherwise."""
        settings, started = self._settings(), self.clock.now()
        await self.doc.update(
            self.store, lambda doc: None if doc.settings == settings else IndexesDoc(settings)
        )
        self._published = (started, settings)

    async def _keep_published(self) -> None:
        if self._published is not None:
            at, settings = self._published
            if settings == self._settings() and self.clock.now() - at < CONFIRM_EVERY_S:
                return
        await self.publish()

    async def until_followers_serve(self, name: str) -> None:
        """The owner, before it starts a new index's workers: until the front ends up serve it."""
        await self._until(lambda r: name not in r.serving, name, "do not serve it yet")

    async def until_followers_drop(self, name: str) -> None:
        """The owner, once it deleted an index: until the front ends up no longer serve it."""
        await self._until(lambda r: name in r.serving, name, "serve it still")

    async def reports(self) -> dict[str, frozenset[str]]:
        """The indexes each other front end up (its report not expired) serves, by front end."""
        return {f: frozenset(r.serving) for f, (_, r) in (await self.reports_of.others()).items()}

    async def _until(self, lagging: Callable[[ServingDoc], bool], name: str, what: str) -> None:
        try:
            await self.publish()
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

    # ---- every other front end ----------------------------------------------------------------------
    async def refresh(self) -> None:
        """Serve the owner's indexes now (a create or delete forwarded to the owner was answered). A
        store that does not answer leaves it to the follow loop: the write's answer is the owner's."""
        try:
            found = await self.store.read(self.doc.name)
        except StoreError as exc:
            log.warning("search indexes: the owner's could not be read (%s): served once the store answers", exc)
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
            _, doc = self.doc.decode(found)
            self._serve(doc.settings)
            self.applied = (found.revision, found.body)
        try:
            await self.report(force=True)  # the owner may be waiting on it
        except StoreError as exc:
            log.debug("search indexes: this front end's report was refused (%s): again shortly", exc)

    def _serve(self, settings: dict[str, dict[str, Any]]) -> None:
        for name in sorted(set(self._serving()) - set(settings)):
            self._drop(name)
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
        log.info("index %s created by the owner front end: served here too", name)

    def _drop(self, name: str) -> None:
        rt = self.server.registry.get(name)
        self.server.remove_version(name, rt.version, NotFound(f"index {name!r} was deleted"))
        log.info("index %s deleted by the owner front end: no longer served here", name)

