"""Front-end membership (cluster/members.py) on a MemoryStore and a fake clock: one live front end per id
(a second refused at start naming the first; a dead one's record taken once it expires), renewal after
the store was away, and front ends with different model repositories reported."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from inferd.clock import FakeClock
from inferd.cluster.members import (
    Member,
    Membership,
    fingerprint,
    members,
    new_member,
    repository_mismatch,
)
from inferd.cluster.memory import MemoryStore
from inferd.cluster.store import StoreError
from inferd.config import ConfigError, ModelConfig

MODELS = {"sim/1": "aaaa", "minilm/1": "bbbb"}


def member(frontend_id: str, models: dict[str, str] = MODELS, **fields: object) -> Member:
    return new_member(frontend_id, frontend_id, dict(models), **fields)  # type: ignore[arg-type]


def sleeps(clock: FakeClock, meanwhile: Callable[[], Awaitable[object]] | None = None) -> Callable[[float], Awaitable[None]]:
    """A sleep on the fake clock, running `meanwhile` (another front end's work) at each."""

    async def sleep(seconds: float) -> None:
        clock.advance(seconds)
        if meanwhile is not None:
            await meanwhile()

    return sleep


async def test_a_front_end_joins_with_its_record() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    me = member("10.0.0.1:8000", workers="10.0.0.1:9000", admin="10.0.0.1:8001", zone="eu-1")
    await Membership(store, me, clock).join()
    found = await members(store)
    assert list(found) == ["10.0.0.1:8000"]
    record = found["10.0.0.1:8000"]
    assert (record.http, record.workers, record.admin, record.zone) == (
        "10.0.0.1:8000", "10.0.0.1:9000", "10.0.0.1:8001", "eu-1"
    )
    assert record.pid == me.pid and record.host == me.host and record.models == MODELS
    clock.advance(10.0)  # not renewed: gone
    assert await members(store) == {}


async def test_a_second_live_front_end_with_the_same_id_is_refused_naming_the_first() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    first = Membership(store, member("fe:8000"), clock)
    await first.join()
    second = Membership(store, member("fe:8000"), clock, sleep=sleeps(clock, first.renew))
    with pytest.raises(ConfigError) as refused:
        await second.join()
    message = str(refused.value)
    assert f"host {first.me.host} (pid {first.me.pid})" in message
    assert "--frontend-id" in message
    record = (await members(store))["fe:8000"]
    assert record.instance == first.me.instance


async def test_a_dead_front_ends_record_is_taken_once_it_expires() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    await Membership(store, member("fe:8000"), clock).join()  # then it dies: never renewed
    restarted = Membership(store, member("fe:8000"), clock, sleep=sleeps(clock))
    await restarted.join()
    assert (await members(store))["fe:8000"].instance == restarted.me.instance


async def test_a_record_expired_while_the_store_was_away_is_written_again() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    mine = Membership(store, member("fe:8000"), clock)
    await mine.join()
    clock.advance(10.0)
    assert await members(store) == {}
    await mine.renew()
    assert (await members(store))["fe:8000"].instance == mine.me.instance


async def test_a_front_end_whose_id_was_taken_meanwhile_leaves_the_other_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    away = Membership(store, member("fe:8000"), clock)
    await away.join()
    clock.advance(10.0)
    other = Membership(store, member("fe:8000"), clock)
    await other.join()
    with caplog.at_level(logging.ERROR, "inferd.cluster"):
        await away.renew()
        await away.renew()
    assert (await members(store))["fe:8000"].instance == other.me.instance
    assert sum("two front ends share one id" in r.message for r in caplog.records) == 1  # logged once
    await away.leave()  # not its record: left alone
    assert "fe:8000" in await members(store)
    await other.leave()
    assert await members(store) == {}


def test_front_ends_with_different_repositories_are_reported() -> None:
    same = {"a:1": member("a:1"), "b:1": member("b:1")}
    assert repository_mismatch(same) is None
    differ = {**same, "c:1": member("c:1", {"sim/1": "aaaa", "minilm/1": "cccc", "llm/2": "dddd"})}
    mismatch = repository_mismatch(differ)
    assert mismatch is not None
    assert [g.frontends for g in mismatch.groups] == [["a:1", "b:1"], ["c:1"]]
    assert mismatch.differing == ["llm/2", "minilm/1"]
    assert "a:1, b:1" in mismatch.message() and "same --model-repo" in mismatch.message()


async def test_a_joining_front_end_with_another_repository_is_logged_and_kept_for_the_admin_api(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    mine = Membership(store, member("a:1"), clock)
    await mine.join()
    assert mine.mismatch is None
    other = Membership(store, member("b:1", {"sim/2": "eeee"}), clock)
    with caplog.at_level(logging.WARNING, "inferd.cluster"):
        await other.join()
        await mine.refresh()
        await mine.refresh()  # nobody new: not logged again
    assert mine.mismatch is not None and mine.mismatch.differing == ["minilm/1", "sim/1", "sim/2"]
    assert sum("different model repositories" in r.message for r in caplog.records) == 2  # each front end's
    assert set(mine.members) == {"a:1", "b:1"}
    await other.leave()  # the odd one gone: nothing differs any more
    await mine.refresh()
    assert mine.mismatch is None and set(mine.members) == {"a:1"}


async def test_run_renews_the_record_and_goes_on_while_the_store_is_away() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    rounds = 0

    async def sleep(seconds: float) -> None:
        nonlocal rounds
        rounds += 1
        clock.advance(seconds)
        if rounds == 6:
            raise asyncio.CancelledError

    mine = Membership(store, member("fe:8000"), clock, sleep=sleep)
    await mine.join()
    with pytest.raises(asyncio.CancelledError):
        await mine.run()
    found = await store.read("frontend/fe:8000")
    assert found is not None and found.revision == 6  # joined, then renewed at each of 5 rounds


def test_the_fingerprint_is_each_model_tomls_digest(tmp_path: Path) -> None:
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "model.toml").write_text('kind = "batch"\n')
    models = [
        ModelConfig.model_construct(name="sim", version=2),
        ModelConfig.model_construct(name="sim", version=1),
    ]
    first = fingerprint(models, tmp_path)
    assert list(first) == ["sim/1", "sim/2"] and first["sim/1"] == first["sim/2"] != ""
    (tmp_path / "sim" / "model.toml").write_text('kind = "batch"\nmax_batch_size = 8\n')
    assert fingerprint(models, tmp_path)["sim/1"] != first["sim/1"]
    assert fingerprint(models, None) == {"sim/1": "", "sim/2": ""}


async def test_run_goes_on_when_the_store_answers_with_errors() -> None:
    """A Redis that answers errors (READONLY after a failover, OOM) is a StoreError, not StoreUnavailable:
    the renewal loop goes on (a loop that ended would stop the server: its task group)."""
    clock = FakeClock()

    class Refusing(MemoryStore):
        refusing = 0

        async def write(self, doc: str, body: bytes, **kw: Any) -> int:
            if self.refusing:
                self.refusing -= 1
                raise StoreError("READONLY You can't write against a read only replica.")
            return await super().write(doc, body, **kw)

    store = Refusing(clock)
    rounds = 0

    async def sleep(seconds: float) -> None:
        nonlocal rounds
        rounds += 1
        clock.advance(seconds)
        if rounds == 6:
            raise asyncio.CancelledError

    mine = Membership(store, member("fe:8000"), clock, sleep=sleep)
    await mine.join()
    store.refusing = 2
    with pytest.raises(asyncio.CancelledError):
        await mine.run()
    found = await store.read("frontend/fe:8000")
    assert found is not None and found.revision == 4  # joined, refused twice, then renewed 3 times
