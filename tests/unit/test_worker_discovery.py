"""Which front ends a worker joins (worker/discovery.py), on a fake clock: the fixed --connect addresses
at once; each dns: name's addresses as its answers come, looked up again every interval; an address
two answers in a row leave out is left; an answer with nothing keeps what the name gave last."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import pytest

from inferd.clock import FakeClock
from inferd.config import ConfigError
from inferd.worker.discovery import LEAVE_AFTER_ANSWERS, Discovery, FrontEnd, Name, parse_connect
from inferd.worker.fronts import transport
from inferd.worker.main import Worker
from inferd.worker.resolver import in_hosts_file

FE = Name("frontends.inferd", 9000)


def addresses(fronts: tuple[FrontEnd, ...]) -> list[str]:
    return sorted(f.address for f in fronts)


def test_connect_takes_addresses_and_dns_names_mixed() -> None:
    assert parse_connect("a:1,dns:fe.svc:2, unix:/run/x.sock") == (["a:1", "unix:/run/x.sock"], [Name("fe.svc", 2)])
    assert parse_connect("dns:fe:9000") == ([], [Name("fe", 9000)])
    assert str(Name("fe", 9000)) == "dns:fe:9000"


@pytest.mark.parametrize("bad", ["dns:fe", "dns::9000", "dns:fe:x", "dns:fe:0", "dns:fe:70000", "dns:a:b:1"])
def test_a_malformed_dns_entry_is_refused_naming_the_form(bad: str) -> None:
    with pytest.raises(ValueError, match=r"not dns:NAME:PORT"):
        parse_connect(f"a:1,{bad}")


def test_an_empty_or_repeated_connect_is_refused() -> None:
    with pytest.raises(ValueError, match="names no front end"):
        parse_connect(" , ")
    with pytest.raises(ValueError, match="twice"):
        parse_connect("dns:fe:1,dns:fe:1")


def test_fixed_addresses_are_joined_at_start_and_names_are_due_at_once() -> None:
    clock = FakeClock()
    d = Discovery(["a:1", "b:1"], [FE], clock, every_s=5.0)
    start = d.start()
    assert addresses(start.join) == ["a:1", "b:1"] and start.leave == ()
    assert d.due() == [FE] and d.next_at() == clock.now()


def test_no_names_never_comes_due() -> None:
    d = Discovery(["a:1"], [], FakeClock())
    d.start()
    assert d.next_at() is None and d.due() == []


def test_each_answer_joins_new_addresses_and_the_name_is_looked_up_again_after_the_interval() -> None:
    clock = FakeClock()
    d = Discovery([], [FE], clock, every_s=5.0)
    d.start()
    first = d.observe(FE, ["10.0.0.1"])
    assert [(f.address, f.name) for f in first.join] == [("10.0.0.1:9000", FE)]
    assert first.join[0].server_hostname == "frontends.inferd"  # TLS checks the name, not the address
    assert d.due() == [] and d.next_at() == clock.now() + 5.0
    clock.advance(4.9)
    assert d.due() == []
    clock.advance(0.1)
    assert d.due() == [FE]
    second = d.observe(FE, ["10.0.0.1", "10.0.0.2", "fd00::3"])
    assert addresses(second.join) == ["10.0.0.2:9000", "[fd00::3]:9000"] and second.leave == ()
    assert sorted(f.address for f in d.joined()) == ["10.0.0.1:9000", "10.0.0.2:9000", "[fd00::3]:9000"]


def test_an_address_is_left_once_two_answers_in_a_row_leave_it_out() -> None:
    assert LEAVE_AFTER_ANSWERS == 2
    d = Discovery([], [FE], FakeClock())
    d.start()
    d.observe(FE, ["10.0.0.1", "10.0.0.2"])
    once = d.observe(FE, ["10.0.0.1"])
    assert once.join == () and once.leave == (), "one answer without it is not enough"
    back = d.observe(FE, ["10.0.0.1", "10.0.0.2"])
    assert back.join == () and back.leave == (), "it came back: the count starts again"
    d.observe(FE, ["10.0.0.1"])
    twice = d.observe(FE, ["10.0.0.1"])
    assert addresses(twice.leave) == ["10.0.0.2:9000"] and twice.join == ()
    again = d.observe(FE, ["10.0.0.1", "10.0.0.2"])
    assert addresses(again.join) == ["10.0.0.2:9000"], "a front end that returns is joined again"


def test_a_name_that_does_not_resolve_at_start_is_retried_and_said_once() -> None:
    clock = FakeClock()
    d = Discovery([], [FE], clock, every_s=5.0)
    d.start()
    failed = d.observe(FE, [], "gaierror: [Errno -2] Name or service not known")
    assert failed.join == () and failed.leave == ()
    assert len(failed.notes) == 1 and "Name or service not known" in failed.notes[0]
    assert "looking again every 5 s" in failed.notes[0]
    clock.advance(5.0)
    assert d.due() == [FE]
    assert d.observe(FE, [], "gaierror: again").notes == (), "said once, not at every lookup"
    ok = d.observe(FE, ["10.0.0.1"])
    assert addresses(ok.join) == ["10.0.0.1:9000"] and any("resolves again" in n for n in ok.notes)


def test_a_name_that_later_resolves_to_nothing_keeps_its_front_ends() -> None:
    d = Discovery([], [FE], FakeClock())
    d.start()
    d.observe(FE, ["10.0.0.1", "10.0.0.2"])
    for _ in range(5):  # a DNS outage: nothing is left, however long it lasts
        outage = d.observe(FE, [], "TimeoutError")
        assert outage.leave == () and outage.join == ()
    assert len(d.joined()) == 2
    assert d.observe(FE, [], "no address").notes == ()
    d2 = Discovery([], [FE], FakeClock())
    d2.start()
    d2.observe(FE, ["10.0.0.1", "10.0.0.2"])
    (note,) = d2.observe(FE, [], "no address").notes
    assert "keeping its 2 front end(s)" in note


def test_an_address_named_twice_is_joined_once_and_stays_while_either_names_it() -> None:
    d = Discovery(["10.0.0.1:9000"], [FE], FakeClock())
    assert addresses(d.start().join) == ["10.0.0.1:9000"]
    both = d.observe(FE, ["10.0.0.1", "10.0.0.2"])
    assert addresses(both.join) == ["10.0.0.2:9000"]
    d.observe(FE, ["10.0.0.2"])
    gone = d.observe(FE, ["10.0.0.2"])
    assert gone.leave == (), "the fixed entry still names it"


def test_two_names_are_followed_each_on_its_own() -> None:
    other = Name("fe-b", 9100)
    d = Discovery([], [FE, other], FakeClock())
    d.start()
    assert addresses(d.observe(FE, ["10.0.0.1"]).join) == ["10.0.0.1:9000"]
    assert addresses(d.observe(other, ["10.0.0.1"]).join) == ["10.0.0.1:9100"]
    d.observe(FE, [])
    assert len(d.joined()) == 2


def test_a_hosts_file_gives_every_address_of_a_name(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(
        "# test hosts\n127.0.0.2 frontends.inferd fe\n127.0.0.3 other Frontends.Inferd  # second\n"
        "::1 frontends.inferd\nnot-an-ip frontends.inferd\n\n"
    )
    assert in_hosts_file(hosts, "frontends.inferd") == ["127.0.0.2", "127.0.0.3", "::1"]
    assert in_hosts_file(hosts, "fe") == ["127.0.0.2"]
    assert in_hosts_file(hosts, "absent") == []


def test_a_dns_name_needs_tls_or_insecure_unless_it_is_loopback() -> None:
    with pytest.raises(ConfigError, match=r"dns:frontends\.inferd:9000"):
        transport("dns:frontends.inferd:9000", None, "", insecure=False)
    assert transport("dns:frontends.inferd:9000", None, "", insecure=True) is None
    assert transport("127.0.0.1:9000,dns:localhost:9000", None, "", insecure=False) is None
    with pytest.raises(ConfigError, match="not dns:NAME:PORT"):
        transport("dns:fe", None, "", insecure=True)


class NoAnswer:
    """A resolver whose name never resolves; the worker drains (SIGTERM) at its third lookup."""

    every_s = 0.001

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.lookups = 0

    async def addresses(self, name: Name) -> list[str]:
        self.lookups += 1
        if self.lookups == 3:
            assert self.worker is not None and self.worker.drain()
        raise socket.gaierror(-2, "Name or service not known")


async def test_a_worker_whose_name_never_resolves_keeps_looking_and_drains_with_no_front_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    resolver = NoAnswer()
    worker = Worker("dns:nowhere.test:9000", "sim", "", "w-0", reconnect=True, resolver=resolver)  # type: ignore[arg-type]
    resolver.worker = worker
    with caplog.at_level(logging.INFO, logger="inferd.worker"):
        assert await asyncio.wait_for(worker.run(), 30) == 0
    assert resolver.lookups == 3
    said = [r.getMessage() for r in caplog.records if "does not resolve" in r.getMessage()]
    assert len(said) == 1 and "Name or service not known" in said[0], said
