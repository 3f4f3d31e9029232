"""Which front ends a worker joins: the addresses `--connect` names, and every address of each
`dns:NAME:PORT` in it, looked up again every RESOLVE_EVERY_S. A plain object: an injected clock, no I/O
(worker/joining.py resolves the names and runs the links; tests drive it on a fake clock).

    --connect a:9000,b:9000            two front ends, for the worker's life
    --connect dns:inferd-fe:9000       every address inferd-fe has (a Kubernetes headless Service)
    --connect a:9000,dns:fe:9000       both kinds

What an answer does (`observe`):
* an address it did not have is joined;
* an address it had that two answers in a row leave out is left (LEAVE_AFTER_ANSWERS: one odd answer,
  e.g. a resolver that returns a subset, never drops a front end). Leaving is gentle: the worker drains
  from that front end alone (worker/main.py `Worker.leave`), so nothing it accepted is dropped;
* an answer with no address, or a lookup that fails, changes nothing: the worker keeps the front ends
  of the last answer that had some (a DNS outage must not drop every front end), says so once, and
  looks again at the next interval. A name that does not resolve at start is looked up again the same
  way (logged once, not an error: the front ends may start after the workers).

An address named twice (a fixed entry, and an answer) is joined once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inferd.clock import Clock
from inferd.wire import protocol as p

RESOLVE_EVERY_S = 5.0
"""How often each dns: name is looked up again (`inferd worker --resolve-every-s`, for tests)."""
LEAVE_AFTER_ANSWERS = 2
"""A front end is left once this many answers in a row leave its address out."""
DNS_PREFIX = "dns:"


@dataclass(frozen=True, slots=True)
class Name:
    """A `dns:NAME:PORT` entry of --connect."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{DNS_PREFIX}{self.host}:{self.port}"

    def address(self, ip: str) -> str:
        """One of its addresses as the worker connects to it: '10.0.0.5:9000', '[fd00::5]:9000'."""
        return f"[{ip}]:{self.port}" if ":" in ip else f"{ip}:{self.port}"


@dataclass(frozen=True, slots=True)
class FrontEnd:
    """One front end to join: where to connect, and (for an address a name gave) that name, which its
    TLS certificate must carry (the address's own host otherwise)."""

    address: str
    name: Name | None = None

    @property
    def server_hostname(self) -> str | None:
        return self.name.host if self.name is not None else None

    def __str__(self) -> str:
        return self.address if self.name is None else f"{self.address} ({self.name})"


@dataclass(frozen=True, slots=True)
class Change:
    """What an answer asks of the worker: front ends to join and to leave, and what to log."""

    join: tuple[FrontEnd, ...] = ()
    leave: tuple[FrontEnd, ...] = ()
    notes: tuple[str, ...] = ()


def parse_connect(connect: str) -> tuple[list[str], list[Name]]:
    """'a:9000,dns:fe:9000' -> (['a:9000'], [Name('fe', 9000)]); ValueError naming the entry at fault."""
    entries = [a.strip() for a in connect.split(",") if a.strip()]
    if not entries:
        raise ValueError(f"--connect {connect!r} names no front end address")
    if len(set(entries)) != len(entries):
        raise ValueError(f"--connect {connect!r} names a front end twice")
    fixed: list[str] = []
    names: list[Name] = []
    for entry in entries:
        if entry.startswith(DNS_PREFIX):
            names.append(_name(entry))
        else:
            p.parse_address(entry)
            fixed.append(entry)
    return fixed, names


def _name(entry: str) -> Name:
    host, sep, port = entry[len(DNS_PREFIX) :].rpartition(":")
    if not sep or not host or ":" in host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"--connect entry {entry!r} is not dns:NAME:PORT (a DNS name, e.g. a Kubernetes headless "
            "Service, and the front ends' --worker-port)"
        )
    return Name(host, int(port))


class Discovery:
    """The front ends to be joined now, and when to look each name up again."""

    def __init__(
        self, fixed: Iterable[str], names: Iterable[Name], clock: Clock, every_s: float = RESOLVE_EVERY_S
    ) -> None:
        self.clock = clock
        self.every_s = every_s
        self._fixed = [FrontEnd(a) for a in fixed]
        self._names = list(names)
        self._addresses: dict[Name, dict[str, int]] = {n: {} for n in self._names}
        """Per name: the addresses it gave, each with how many answers in a row left it out since."""
        self._failing: dict[Name, str] = {}
        """Names whose last lookup gave nothing, with why (said once, until one answers again)."""
        self._next_at = {n: clock.now() for n in self._names}
        self._joined: dict[str, FrontEnd] = {}

    @property
    def names(self) -> list[Name]:
        return list(self._names)

    def joined(self) -> list[FrontEnd]:
        return list(self._joined.values())

    def start(self) -> Change:
        """The fixed addresses, joined at once (the names' follow their first answers)."""
        return self._reconcile(())

    def next_at(self) -> float | None:
        """When the next name is due for a lookup; None: no dns: names."""
        return min(self._next_at.values(), default=None)

    def due(self) -> list[Name]:
        now = self.clock.now()
        return [n for n, at in self._next_at.items() if at <= now]

    def observe(self, name: Name, ips: Iterable[str], error: str = "") -> Change:
        """A lookup of `name` ended: `ips` its addresses (empty, with `error` saying why, when it failed)."""
        self._next_at[name] = self.clock.now() + self.every_s
        answer = {name.address(ip) for ip in ips}
        had = self._addresses[name]
        if not answer:
            return self._nothing(name, had, error or "no address")
        notes: list[str] = []
        if name in self._failing:
            del self._failing[name]
            notes.append(f"{name} resolves again")
        for address in list(had):
            if address in answer:
                had[address] = 0
                continue
            had[address] += 1
            if had[address] >= LEAVE_AFTER_ANSWERS:
                del had[address]
        for address in answer:
            had.setdefault(address, 0)
        return self._reconcile(notes)

    def _nothing(self, name: Name, had: dict[str, int], why: str) -> Change:
        if name in self._failing:
            return Change()
        self._failing[name] = why
        every = f"looking again every {self.every_s:g} s"
        if had:
            note = f"{name} does not resolve ({why}): keeping its {len(had)} front end(s), {every}"
        else:
            note = f"{name} does not resolve ({why}): no front end of it joined yet, {every}"
        return Change(notes=(note,))

    def _reconcile(self, notes: Iterable[str]) -> Change:
        """Join what is wanted and not joined, leave what is joined and no longer wanted."""
        wanted = {f.address: f for f in self._fixed}
        for name, addresses in self._addresses.items():
            for address in addresses:
                wanted.setdefault(address, FrontEnd(address, name))
        join = tuple(f for a, f in wanted.items() if a not in self._joined)
        leave = tuple(f for a, f in self._joined.items() if a not in wanted)
        self._joined = {a: self._joined.get(a, f) for a, f in wanted.items()}
        said = list(notes)
        if join or leave:
            said.append(
                "front ends to join: "
                + (", ".join(map(str, join)) or "none")
                + "; to leave: "
                + (", ".join(map(str, leave)) or "none")
            )
        return Change(join, leave, tuple(said))
