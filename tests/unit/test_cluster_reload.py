"""`POST /admin/reload` with several front ends (cluster/reload.py), through the config generation of the
served document on a MemoryStore: the answer comes once every front end up has re-read the file; one
that refuses the file is named with its reason, one that stopped reporting is not waited for, a file
refused where the reload came changes nothing anywhere, and a reload the store does not take applies
here, marked diverged, until the store answers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from inferd.clock import FakeClock
from inferd.cluster.memory import MemoryStore
from inferd.cluster.reload import ConfigReload, one_frontend, outcome
from inferd.cluster.served import REPORT_TTL_S, SERVED, ServedVersions
from inferd.cluster.store import StoreUnavailable
from inferd.config import ConfigError
from inferd.kinds.builtin import builtin_kinds
from inferd.runtime.registry import ModelRegistry


class Files:
    """Each front end's reads of the config file; `refuse[i]`: front end i finds the file invalid."""

    def __init__(self, n: int) -> None:
        self.reads = [0] * n
        self.refuse = [False] * n

    def reader(self, i: int) -> Callable[[], dict[str, int]]:
        def reload() -> dict[str, int]:
            if self.refuse[i]:
                raise ConfigError(f"line 3 of the file front end {i} read is not valid")
            self.reads[i] += 1
            return {"read_by": i}

        return reload


class FrontEnd:
    """One front end's config generation and its report (what the follow loop drives)."""

    def __init__(self, store: MemoryStore, i: int, n: int, files: Files | None, clock: FakeClock) -> None:
        self.store = store
        self.config = ConfigReload(store, str(i), i, n, files.reader(i) if files else None)
        self.config.wait_s = 10.0
        server = SimpleNamespace(registry=ModelRegistry(), kinds=builtin_kinds(), fleet=SimpleNamespace(updates=dict))
        self.versions = ServedVersions(store, str(i), server, clock, None, i)
        self.versions.config = self.config

    async def step(self) -> None:
        """One read of the served document: apply it, and report."""
        await self.versions.apply(await self.store.read(SERVED.name))


async def answered(task: asyncio.Task[dict], within_s: float = 5.0) -> dict:
    return await asyncio.wait_for(task, within_s)


def front_ends(n: int, files: Files | None, clock: FakeClock) -> list[FrontEnd]:
    store = MemoryStore(clock)
    return [FrontEnd(store, i, n, files, clock) for i in range(n)]


async def test_reload_is_answered_once_every_front_end_up_has_read_the_file() -> None:
    clock = FakeClock()
    files = Files(3)
    first, f1, f2 = front_ends(3, files, clock)
    for f in (first, f1, f2):
        await f.step()  # a starting front end takes the generation as it is: it read the file as it started
    await f1.step()
    assert files.reads == [0, 0, 0]

    reloading = asyncio.create_task(first.config.reload())
    await asyncio.sleep(0.05)
    assert files.reads == [1, 0, 0] and not reloading.done()  # read here; waits for the others
    await f1.step()
    await asyncio.sleep(0.2)
    assert files.reads == [1, 1, 0] and not reloading.done()  # front end 2 has not read it yet
    await f1.step()
    assert files.reads == [1, 1, 0]  # and not again while the generation stays
    files.refuse[2] = True
    await f2.step()
    answer = await answered(reloading)
    assert answer["read_by"] == 0
    assert answer["frontends"] == {
        "count": 3,
        "reloaded": [0, 1],
        "refused": {"2": "line 3 of the file front end 2 read is not valid"},
        "not_answered": [],
        "complete": False,
    }

    # front end 2 stops reporting (dead, restarting): the next reload does not wait for it
    clock.advance(REPORT_TTL_S + 1)
    await f1.step()
    reloading = asyncio.create_task(first.config.reload())
    await asyncio.sleep(0.05)
    await f1.step()
    answer = await answered(reloading)
    assert answer["frontends"]["reloaded"] == [0, 1] and answer["frontends"]["not_answered"] == [2]
    assert files.reads == [2, 2, 0]

    # a file refused where the reload came: the admin call fails, and nobody else reads anything
    files.refuse[0] = True
    with pytest.raises(ConfigError):
        await first.config.reload()
    await f1.step()
    assert files.reads == [2, 2, 0]


async def test_a_restarted_owner_has_every_other_front_end_read_the_file_again() -> None:
    """The store outlives the front end that decides; one started again read the file as it started,
    and so do the others then (the file may have changed while it was away)."""
    clock = FakeClock()
    files = Files(2)
    _, other = front_ends(2, files, clock)
    await other.step()
    for _ in range(2):  # the owner starts, then is started again: a new process each time
        first = FrontEnd(other.store, 0, 2, files, clock)
        await first.step()
        await first.config.started()
        await other.step()
        await other.step()
    assert files.reads == [0, 2]


async def test_two_reloads_at_once_are_both_answered_when_the_others_read_the_later() -> None:
    clock = FakeClock()
    files = Files(2)
    first, other = front_ends(2, files, clock)
    await first.step()
    await other.step()
    one = asyncio.create_task(first.config.reload())
    two = asyncio.create_task(first.config.reload())
    await asyncio.sleep(0.05)
    await other.step()  # reads the file once, for the second reload
    for task in (one, two):
        assert (await answered(task))["frontends"]["reloaded"] == [0, 1]
    assert files.reads == [2, 1]


async def test_a_front_end_that_stops_reporting_holds_the_answer_only_until_it_stops_counting() -> None:
    clock = FakeClock()
    files = Files(2)
    first, other = front_ends(2, files, clock)
    await other.step()
    reloading = asyncio.create_task(first.config.reload())
    await asyncio.sleep(0.05)
    assert not reloading.done()  # it waits for front end 1, up
    clock.advance(REPORT_TTL_S + 0.1)  # which then reports no more (stopped, or its loop is stuck)
    answer = await answered(reloading, within_s=2.0)  # not the 10 s deadline
    assert answer["frontends"]["not_answered"] == [1] and answer["frontends"]["complete"] is False


async def test_without_a_config_file_nobody_reads_and_a_reload_is_refused() -> None:
    clock = FakeClock()
    first, other = front_ends(2, None, clock)
    await other.step()
    with pytest.raises(ConfigError, match="without --config"):
        await first.config.reload()
    await SERVED.update(first.store, lambda s: type(s)(generation=s.generation + 1))  # moved anyway
    await other.step()  # takes it as it is: nothing to read, nothing refused
    assert other.config.taken == 1 and other.config.refused == ""


async def test_one_front_end_answers_as_the_only_one() -> None:
    files = Files(1)
    (alone,) = front_ends(1, files, FakeClock())
    await alone.step()
    answer = await alone.config.reload()
    assert answer == {"read_by": 0, "frontends": one_frontend()} and files.reads == [1]
    assert outcome(0, 1, []) == one_frontend()


async def test_a_reload_the_store_does_not_take_applies_here_diverged_until_it_answers() -> None:
    class Flaky(MemoryStore):
        down = False

        async def read(self, doc: str):  # type: ignore[no-untyped-def]
            if self.down:
                raise StoreUnavailable("no answer within 2 s")
            return await super().read(doc)

    clock = FakeClock()
    store = Flaky(clock)
    files = Files(2)
    first, other = FrontEnd(store, 0, 2, files, clock), FrontEnd(store, 1, 2, files, clock)
    await first.step()
    await other.step()
    store.down = True
    answer = await first.config.reload()  # a leaked key is revoked here at once
    assert answer["diverged"] is True and files.reads == [1, 0]
    assert answer["frontends"]["reloaded"] == [0] and answer["frontends"]["not_answered"] == [1]
    assert first.config.diverged
    with pytest.raises(StoreUnavailable):
        await first.config.converge()
    assert first.config.diverged
    store.down = False
    await first.config.converge()  # the store is back: the generation moves, the others read their files
    assert not first.config.diverged
    await other.step()
    assert files.reads == [1, 1]
