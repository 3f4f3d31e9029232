"""`POST /admin/reload` with several front ends (frontends/config_sync.py), over the plan's real owner
socket: the owner answers once every follower up has re-read the file; a follower that refuses the file
is named with its reason, one that stopped asking is not waited for, and a file the owner refuses
changes nothing anywhere."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from inferd.clock import FakeClock
from inferd.config import ConfigError
from inferd.frontends.config_sync import KIND, ConfigSync
from inferd.frontends.followers import LIVE_S
from inferd.frontends.owner_channel import OwnerChannel
from inferd.frontends.plan import FrontendPlan


@pytest.fixture
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="inferd-cfg-")  # short: a Unix socket path has ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


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


async def answered(task: asyncio.Task[dict], within_s: float = 5.0) -> dict:
    return await asyncio.wait_for(task, within_s)


@contextlib.asynccontextmanager
async def front_ends(
    socket_dir: str, n: int, files: Files | None, clock: FakeClock
) -> AsyncIterator[tuple[ConfigSync, OwnerChannel, list[ConfigSync]]]:
    """The owner (listening on the plan's socket) and n - 1 followers; `files` None: no config file."""
    plan = FrontendPlan(0, n, socket_dir, "token")
    channel = OwnerChannel(plan)
    owner = ConfigSync(plan, channel, files.reader(0) if files else None, clock)
    await channel.open()
    followers = [
        ConfigSync(plan.at(i), OwnerChannel(plan.at(i)), files.reader(i) if files else None, clock)
        for i in range(1, n)
    ]
    try:
        yield owner, channel, followers
    finally:
        channel.close()


async def test_reload_is_answered_once_every_follower_up_has_read_the_file(socket_dir: str) -> None:
    clock = FakeClock()
    files = Files(3)
    async with front_ends(socket_dir, 3, files, clock) as (owner, _, (f1, f2)):
        await f1.exchange()
        await f2.exchange()
        assert files.reads == [0, 1, 1]  # a follower takes the owner's generation once: it reads the file
        await f1.exchange()
        assert files.reads == [0, 1, 1]  # and not again while the owner's generation stays

        reloading = asyncio.create_task(owner.reload())
        await asyncio.sleep(0.05)
        assert files.reads == [1, 1, 1] and not reloading.done()  # read here; waits for the followers
        await f1.exchange()
        await asyncio.sleep(0.05)
        assert files.reads == [1, 2, 1] and not reloading.done()  # front end 2 has not read it yet
        files.refuse[2] = True
        await f2.exchange()
        answer = await answered(reloading)
        assert answer["read_by"] == 0
        assert answer["frontends"] == {
            "count": 3,
            "reloaded": [0, 1],
            "refused": {"2": "line 3 of the file front end 2 read is not valid"},
            "not_answered": [],
            "complete": False,
        }

        # front end 2 stops asking (dead, restarting): the next reload does not wait for it
        clock.advance(LIVE_S + 1)
        await f1.exchange()
        reloading = asyncio.create_task(owner.reload())
        await asyncio.sleep(0.05)
        await f1.exchange()
        answer = await answered(reloading)
        assert answer["frontends"]["reloaded"] == [0, 1] and answer["frontends"]["not_answered"] == [2]
        assert files.reads == [2, 3, 1]

        # a file the owner refuses: the admin call fails, and no follower reads anything
        files.refuse[0] = True
        with pytest.raises(ConfigError):
            await owner.reload()
        await f1.exchange()
        assert files.reads == [2, 3, 1]


async def test_a_restarted_owner_has_every_follower_read_the_file_again(socket_dir: str) -> None:
    """A generation names the owner process: one started again read the file as it started, and so do
    the followers then (the file may have changed while the owner was away)."""
    clock = FakeClock()
    plan = FrontendPlan(0, 2, socket_dir, "token")
    files = Files(2)
    follower = ConfigSync(plan.at(1), OwnerChannel(plan.at(1)), files.reader(1), clock)
    for _ in range(2):
        channel = OwnerChannel(plan)
        ConfigSync(plan, channel, files.reader(0), clock)
        await channel.open()
        try:
            await follower.exchange()
            await follower.exchange()
        finally:
            channel.close()
    assert files.reads == [0, 2]


async def test_two_reloads_at_once_are_both_answered_when_the_followers_read_the_later(
    socket_dir: str,
) -> None:
    clock = FakeClock()
    files = Files(2)
    async with front_ends(socket_dir, 2, files, clock) as (owner, _, (follower,)):
        await follower.exchange()
        first = asyncio.create_task(owner.reload())
        second = asyncio.create_task(owner.reload())
        await asyncio.sleep(0.05)
        await follower.exchange()  # reads the file once, for the second reload
        for task in (first, second):
            assert (await answered(task))["frontends"]["reloaded"] == [0, 1]
        assert files.reads == [2, 2]


async def test_a_follower_that_stops_asking_holds_the_answer_only_until_it_stops_counting(
    socket_dir: str,
) -> None:
    clock = FakeClock()
    files = Files(2)
    async with front_ends(socket_dir, 2, files, clock) as (owner, _, (follower,)):
        await follower.exchange()
        reloading = asyncio.create_task(owner.reload())
        await asyncio.sleep(0.05)
        assert not reloading.done()  # it waits for front end 1, up
        clock.advance(LIVE_S + 0.1)  # which then asks no more (stopped, or its loop is stuck)
        answer = await answered(reloading, within_s=2.0)  # not the 10 s deadline
        assert answer["frontends"]["not_answered"] == [1] and answer["frontends"]["complete"] is False


async def test_without_a_config_file_followers_read_nothing_and_a_garbled_answer_is_ignored(
    socket_dir: str,
) -> None:
    clock = FakeClock()
    async with front_ends(socket_dir, 2, None, clock) as (owner, channel, (follower,)):
        await follower.exchange()  # takes the owner's generation; no file to read, nothing logged
        assert follower.taken.generation == owner.generation and follower.taken.error == ""
        with pytest.raises(ConfigError, match="without --config"):
            await owner.reload()

        async def garbled(payload: bytes) -> bytes:
            return b'{"owner": 1'  # an owner that died while answering

        channel.handle(KIND, garbled, 1.0)
        await follower.exchange()  # no exception: the sync loop goes on
        assert follower.taken.generation == owner.generation
