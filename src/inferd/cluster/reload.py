"""`POST /admin/reload` reaches every front end before it is answered, through the config generation of
the `served` document (cluster/served.py).

The front end that gets the request re-reads its config file (a file that does not validate is refused
whole, and nothing changes anywhere), moves the generation (compare-and-set), and answers once every
live front end has re-read its file for that generation: at most FOLLOWERS_WAIT_S, and the answer's
`frontends` says which front ends reloaded, which refused the file (and why) and which did not answer
in time. So a client that adds an API key and reloads can use the key at once, whichever front end its
next connection reaches. Each front end re-reads its file when the generation it follows moves past the
one it took, and says so in its report (`serving/<frontend>`: the generation, and a refusal's reason).
A front end that starts takes the generation as it is (it read the file as it started); the one that
decides moves it as it starts (`started`), so the others read their files again, as they would after
a reload: the file may have changed while it was away.

When the store does not answer, the reload still applies on the front end that got it (so a leaked key
can always be revoked), marked diverged (`"diverged": true` in the answer,
`inferd_cluster_config_diverged 1`): once the store answers again this front end moves the generation,
and the others read their files too. `kill -HUP` still re-reads the file in each front end it reaches,
answered by nobody.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from inferd.cluster.served import FOLLOWERS_WAIT_S, SERVED, ServedState, Serving, serving_reports
from inferd.cluster.store import Store, StoreError
from inferd.config import ConfigError

log = logging.getLogger("inferd.cluster")


def one_frontend() -> dict[str, Any]:
    """The answer's `frontends` when there is one."""
    return {"count": 1, "reloaded": [0], "refused": {}, "not_answered": [], "complete": True}


def outcome(me: int | str, count: int | None, taken: list[Serving]) -> dict[str, Any]:
    """Every front end's part in a reload: `me` (which reloaded already), and `taken`, the live reports
    at (or past) its generation; `count`: the front ends there are (one host's N), else those heard of."""
    refused = {str(r.name): r.refused for r in taken if r.refused}
    answered = {r.name for r in taken}
    everyone = set(range(count)) if count is not None else answered | {me}
    not_answered = sorted(everyone - answered - {me}, key=str)
    return {
        "count": len(everyone),
        "reloaded": sorted([me, *(r.name for r in taken if not r.refused)], key=str),
        "refused": refused,
        "not_answered": not_answered,
        "complete": not refused and not not_answered,
    }


class ConfigReload:
    def __init__(
        self,
        store: Store,
        me: str,
        name: int | str,
        count: int | None,
        reload_here: Callable[[], Mapping[str, Any]] | None,
    ) -> None:
        self.store = store
        self.me = me
        self.reports = serving_reports(store, me)
        self.name = name
        """How answers name this front end (its index on one host)."""
        self.count = count
        self.reload_here = reload_here
        """Re-read the config file here (ConfigError: refused whole, the running one stays); None: the
        server has no config file (every generation is taken as it is)."""
        self.wait_s = FOLLOWERS_WAIT_S
        self.taken: int | None = None
        """The generation this front end has read its file for (None: none seen yet)."""
        self.refused = ""
        self.diverged = False
        """A reload applied here that the store did not take: the others have not read their files."""
        self._lock = asyncio.Lock()

    async def apply(self, generation: int) -> None:
        """The served document's generation, as read: re-read the file when it moved."""
        async with self._lock:
            if self.taken is None or self.reload_here is None:
                self.taken = generation if self.taken is None else max(self.taken, generation)
                return
            if generation <= self.taken:
                return
            error = ""
            try:
                self.reload_here()
            except ConfigError as exc:
                error = str(exc)
                log.error("reload: config not reloaded, the running tenants, keys and models stay: %s", exc)
            except Exception as exc:  # a bug in applying it: reported, and following goes on
                error = f"{type(exc).__name__}: {exc}"
                log.exception("reload: applying the config failed; the running tenants, keys and models stay")
            self.taken, self.refused = generation, error

    async def reload(self) -> dict[str, Any]:
        """POST /admin/reload: here (ConfigError: refused, nothing changes anywhere), then everywhere."""
        if self.reload_here is None:
            raise ConfigError("the server was started without --config: there is no file to reload")
        async with self._lock:
            summary = dict(self.reload_here())
            try:
                generation = await self._move()
            except StoreError as exc:
                self.diverged = True
                log.error(
                    "reload: applied on this front end only: the cluster store does not answer (%s); the "
                    "others read their files once it does",
                    exc,
                )
                return {**summary, "diverged": True, "frontends": outcome(self.name, self.count, [])}
        behind = await self.reports.until(lambda r: r.generation < generation, self.wait_s)
        taken = sorted(
            (r for _, r in (await self.reports.others()).values() if r.generation >= generation), key=lambda r: str(r.name)
        )
        answer = outcome(self.name, self.count, taken)
        if behind or answer["refused"]:
            log.warning("reload: front ends %s refused the file or did not answer in time", answer)
        return {**summary, "frontends": answer}

    async def converge(self) -> None:
        """A reload applied while the store was down: move the generation now (StoreError: still down)."""
        if self.diverged:
            async with self._lock:
                await self._move()
            self.diverged = False
            log.info("reload: the cluster store answers again: the other front ends read their files now")

    async def started(self) -> None:
        """The front end that decides has (re)started and read its file: the others read theirs again
        (it may have changed while it was away). StoreError: they keep what they run."""
        if self.reload_here is not None:
            async with self._lock:
                await self._move()

    async def _move(self) -> int:
        def change(state: ServedState) -> ServedState:  # past ours too: a store that lost its state
            return msgspec.structs.replace(state, generation=max(state.generation, self.taken or 0) + 1)

        _, state = await SERVED.update(self.store, change)
        self.taken, self.refused = state.generation, ""
        return state.generation


class DivergedCollector:
    """`inferd_cluster_config_diverged`: 1 while a reload applied here has not reached the store."""

    def __init__(self, reload: ConfigReload) -> None:
        self.reload = reload

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "inferd_cluster_config_diverged",
            "1 while a config reload applied on this front end has not reached the cluster store",
            value=1.0 if self.reload.diverged else 0.0,
        )
