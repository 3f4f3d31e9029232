"""Which front ends form the server: each one keeps its record `frontend/<id>` in the store (written with
a ttl, renewed every RENEW_EVERY_S), so the others see who is there, where to reach it, and what it serves.

- **One id, one live front end.** `Membership.join` refuses at start a front end whose id a live one holds
  (ConfigError naming the first's host and pid, with the fix). A record found at start may be that of a
  front end that just died (a restart): it is live only if it is renewed, so join waits up to its ttl
  for it to expire before refusing.
- **One model repository.** Each record carries a fingerprint of the front end's models (names, versions,
  a digest of each model.toml). `repository_mismatch` reports front ends configured with different ones:
  logged at start and whenever a front end joins, and kept (`Membership.mismatch`) for the admin API.
  Front ends that differ are reported, not silently split.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path

import msgspec

from inferd.clock import Clock
from inferd.cluster.store import RevisionConflict, Store, StoreError
from inferd.config import ConfigError, ModelConfig

log = logging.getLogger("inferd.cluster")

PREFIX = "frontend/"
TTL_S = 3.0
"""A record not renewed for this long is gone: the front end died or lost the store."""
RENEW_EVERY_S = 1.0


class Member(msgspec.Struct, frozen=True, kw_only=True):
    """A front end's record (`frontend/<id>`); fields have defaults so older records still decode."""

    id: str = ""
    http: str = ""
    """Its HTTP address (HOST:PORT)."""
    workers: str | None = None
    """Where workers on other hosts join it (HOST:PORT); None: local workers only."""
    admin: str | None = None
    """Its admin API (HOST:PORT); None: none."""
    channel: str | None = None
    """Where the other front ends send it requests (frontends/channel.py: HOST:PORT over TCP, or
    `unix:PATH` on its host); None: not yet known (it opens once it runs), or none."""
    zone: str | None = None
    pid: int = 0
    host: str = ""
    started_at: float = 0.0
    """Wall-clock seconds (time.time) when it started."""
    instance: str = ""
    """Random per process: tells this front end's record from another's with the same id."""
    models: dict[str, str] = {}
    """"name/version" -> digest of its model.toml ("" without a model repository)."""
    repository: str = ""
    """Digest of `models`: front ends with the same one serve the same repository."""


def fingerprint(models: Iterable[ModelConfig], repo: Path | None) -> dict[str, str]:
    """"name/version" -> a digest of the model's model.toml in `repo` ("" when there is none)."""
    found: dict[str, str] = {}
    for m in sorted(models, key=lambda m: (m.name, m.version)):
        toml = None if repo is None else repo / m.name / "model.toml"
        try:
            digest = "" if toml is None else hashlib.sha256(toml.read_bytes()).hexdigest()[:16]
        except OSError:
            digest = ""
        found[f"{m.name}/{m.version}"] = digest
    return found


def new_member(
    frontend_id: str, http: str, models: dict[str, str], *, workers: str | None = None,
    admin: str | None = None, zone: str | None = None,
) -> Member:
    """This process's record; `models` from `fingerprint`."""
    repository = hashlib.sha256(msgspec.msgpack.encode(sorted(models.items()))).hexdigest()[:16]
    return Member(
        id=frontend_id, http=http, workers=workers, admin=admin, zone=zone, pid=os.getpid(),
        host=socket.gethostname(), started_at=time.time(), instance=secrets.token_hex(8), models=models,
        repository=repository,
    )


class RepositoryGroup(msgspec.Struct, frozen=True):
    repository: str
    frontends: list[str]
    models: dict[str, str]


class RepositoryMismatch(msgspec.Struct, frozen=True):
    """Front ends serving different model repositories: each repository's front ends, and the models
    ("name/version") that are not the same on all of them."""

    groups: list[RepositoryGroup]
    differing: list[str]

    def message(self) -> str:
        groups = "; ".join(f"{', '.join(g.frontends)} ({len(g.models)} model versions)" for g in self.groups)
        return (
            f"front ends serve different model repositories: {groups}; not the same everywhere: "
            f"{', '.join(self.differing)}. Give every front end the same --model-repo (and [models.NAME])"
        )


def repository_mismatch(members: Mapping[str, Member]) -> RepositoryMismatch | None:
    """None when every front end serves the same repository."""
    by_repo: dict[str, list[Member]] = {}
    for member in members.values():
        by_repo.setdefault(member.repository, []).append(member)
    if len(by_repo) < 2:
        return None
    groups = [
        RepositoryGroup(repo, sorted(m.id for m in group), dict(group[0].models))
        for repo, group in sorted(by_repo.items(), key=lambda item: sorted(m.id for m in item[1]))
    ]
    keys = set().union(*(g.models for g in groups))
    differing = sorted(k for k in keys if len({g.models.get(k) for g in groups}) > 1)
    return RepositoryMismatch(groups, differing)


_decoder = msgspec.msgpack.Decoder(Member)


def decode(body: bytes) -> Member | None:
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError:
        return None


async def members(store: Store) -> dict[str, Member]:
    """Every live front end's record, by id (a record that does not decode is left out)."""
    found = await store.read_prefix(PREFIX)
    return {m.id: m for v in found.values() if (m := decode(v.body)) is not None}


class Membership:
    """This front end's record: `join` at start, then `run` renews it and follows the others."""

    def __init__(
        self, store: Store, me: Member, clock: Clock, ttl_s: float = TTL_S, every_s: float = RENEW_EVERY_S,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.store = store
        self.me = me
        self.doc = PREFIX + me.id
        self.clock = clock
        self.ttl_s = ttl_s
        self.every_s = every_s
        self.sleep = sleep
        self.revision = 0
        """Our record's revision as last written (0: not written)."""
        self.members: dict[str, Member] = {}
        self.mismatch: RepositoryMismatch | None = None
        self._taken_by: str | None = None

    async def join(self) -> None:
        """Write our record, or refuse: ConfigError when a live front end holds our id (see the module's
        doc). StoreUnavailable when the store does not answer."""
        deadline = self.clock.now() + self.ttl_s + self.every_s
        seen: int | None = None
        while True:
            found = await self.store.read(self.doc)
            holder = None if found is None else decode(found.body)
            if found is None or (holder is not None and holder.instance == self.me.instance):
                try:
                    self.revision = await self._write(0 if found is None else found.revision)
                except RevisionConflict:
                    continue  # another took it between our read and write: seen as live next round
                await self.refresh()
                return
            if (seen is not None and found.revision != seen) or self.clock.now() >= deadline:
                raise ConfigError(self._refusal(holder))
            seen = found.revision
            await self.sleep(self.every_s / 4)

    def _refusal(self, holder: Member | None) -> str:
        who = "a front end" if holder is None else f"the front end on host {holder.host} (pid {holder.pid})"
        return (
            f"front end id {self.me.id!r} is taken by {who}, which is live: give this one its own "
            "--frontend-id (or HTTP address), or stop that one first"
        )

    async def _write(self, expect: int) -> int:
        return await self.store.write(self.doc, msgspec.msgpack.encode(self.me), expect=expect, ttl_s=self.ttl_s)

    async def publish(self, me: Member) -> None:
        """Our record is now `me` (an address known once it listens): written at once."""
        self.me = me
        await self.renew()

    async def renew(self) -> None:
        """Write our record again (compare-and-set on our last revision); when another front end wrote
        our id meanwhile (ours expired while the store was away), log it and leave its record alone."""
        try:
            self.revision = await self._write(self.revision)
            self._taken_by = None
            return
        except RevisionConflict:
            pass
        found = await self.store.read(self.doc)
        holder = None if found is None else decode(found.body)
        if found is None or (holder is not None and holder.instance == self.me.instance):
            with_revision = 0 if found is None else found.revision
            self.revision = await self._write(with_revision)  # ours expired, or our write's answer was lost
            return
        who = f"{holder.host} pid {holder.pid}" if holder is not None else "an undecodable record"
        if self._taken_by != who:
            log.error("front end id %r is now also held by %s: two front ends share one id", self.me.id, who)
            self._taken_by = who

    async def refresh(self) -> dict[str, Member]:
        """Read every front end's record; log joins and departures, and the repository mismatch whenever
        a front end joins."""
        current = await members(self.store)
        joined = sorted(set(current) - set(self.members))
        for gone in sorted(set(self.members) - set(current)):
            log.info("front end %s left (its record expired or was removed)", gone)
        for new in joined:
            if new != self.me.id:
                m = current[new]
                log.info("front end %s joined (host %s, pid %d, zone %s)", new, m.host, m.pid, m.zone)
        changed = set(current) != set(self.members)
        self.members = current
        if changed:  # a front end joined or left: the mismatch as it is now (logged whenever one joins)
            self.mismatch = repository_mismatch(current)
            if self.mismatch is not None and joined:
                log.warning("%s", self.mismatch.message())
        return current

    async def run(self) -> None:
        """Until cancelled: renew our record and read the others' every `every_s` (the store away: try
        again next time; our record expires and is written again once it is back)."""
        while True:
            await self.sleep(self.every_s)
            try:
                await self.renew()
                await self.refresh()
            except StoreError:  # down, or answering errors (a read-only replica after a failover): tried again
                continue

    async def leave(self) -> None:
        """At a clean stop: remove our record (if it is still ours) so the id is free at once."""
        try:
            found = await self.store.read(self.doc)
            holder = None if found is None else decode(found.body)
            if holder is not None and holder.instance == self.me.instance:
                await self.store.delete(self.doc)
        except StoreError as exc:
            log.info("front end %s could not remove its record (%s): it expires in %.0f s", self.me.id, exc, self.ttl_s)
