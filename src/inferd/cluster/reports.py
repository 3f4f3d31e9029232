"""What each front end says of itself, of one kind: its report is the document `<prefix><frontend>`,
written with a ttl so that a front end that died, hung or lost the store stops counting once it expires,
and read by the others. The one mechanism behind every "what does each live front end say": the versions
it serves and the config generation it took (cluster/served.py, cluster/reload.py), its load
(cluster/load.py), the search indexes it serves (kinds/search/shared_indexes.py). One encoding (msgpack
of the report's msgspec type, as `Document`), one ttl rule, one wait (`until`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Generic, TypeVar

import msgspec

from inferd.cluster.store import Store

RECHECK_S = 0.1
"""How often a wait on the reports reads them again (they are other front ends' documents: polled)."""

T = TypeVar("T")


class Reports(Generic[T]):
    def __init__(self, store: Store, prefix: str, type_: type[T], me: str, ttl_s: float) -> None:
        self.store = store
        self.prefix = prefix
        self.me = me
        """This front end's id: its own report is `prefix + me`."""
        self.ttl_s = ttl_s
        self._decoder = msgspec.msgpack.Decoder(type_)

    async def publish(self, report: T) -> int:
        """Write this front end's report (it expires after ttl_s unless written again); its revision."""
        return await self.store.write(self.prefix + self.me, msgspec.msgpack.encode(report), ttl_s=self.ttl_s)

    async def others(self) -> dict[str, tuple[int, T]]:
        """The other front ends' live reports, by front end: (revision, report). One that does not decode
        (written by a front end of another schema) is left out. StoreError."""
        found: dict[str, tuple[int, T]] = {}
        for doc, value in (await self.store.read_prefix(self.prefix)).items():
            frontend = doc[len(self.prefix) :]
            if frontend != self.me:
                with contextlib.suppress(msgspec.DecodeError):
                    found[frontend] = (value.revision, self._decoder.decode(value.body))
        return found

    async def until(self, lagging: Callable[[T], bool], wait_s: float) -> dict[str, T]:
        """Until no other live front end's report is `lagging`, read every RECHECK_S: those still lagging
        after `wait_s`, by front end ({} when none). StoreError when the store fails meanwhile."""
        behind: dict[str, T] = {}
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                while True:
                    behind = {f: r for f, (_, r) in (await self.others()).items() if lagging(r)}
                    if not behind:
                        return {}
                    await asyncio.sleep(RECHECK_S)
        return {f: r for f, (_, r) in (await self.others()).items() if lagging(r)}
