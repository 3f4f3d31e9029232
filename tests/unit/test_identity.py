"""Who front ends and workers are (config/identity.py): a zone is a DNS label, refused otherwise with the
rule named; a front end's id is `--frontend-id` or its HTTP HOST:PORT; a worker says its zone in Hello and
the admin API shows it; a worker of another protocol is refused at join with both numbers."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from inferd.api.admin import worker_row
from inferd.clock import FakeClock
from inferd.config import ConfigError, ServerConfig, load_server_config
from inferd.config.identity import ZONE_RULE, admin_address, check_frontend_id, check_zone, frontend_id
from inferd.kinds.batch.admin_view import BATCH_ADMIN
from inferd.models.sim import sim_config
from inferd.runtime.hub import WorkerHub
from inferd.runtime.membership import WorkerDirectory
from inferd.wire import protocol as p
from tests.unit.test_worker_directory import built, until


@pytest.mark.parametrize("zone", ["a", "z9", "us-east-1a", "0", "a" * 63, "eu-west-2-b"])
def test_a_dns_label_is_a_zone(zone: str) -> None:
    assert check_zone(zone) == zone
    assert ServerConfig(zone=zone).zone == zone


@pytest.mark.parametrize(
    "zone", ["", "A", "us_east", "-a", "a-", "a.b", "a b", "a" * 64, "zone\n", "é"]
)
def test_anything_else_is_refused_naming_the_rule(zone: str) -> None:
    with pytest.raises(ValueError, match="not a DNS label") as caught:
        check_zone(zone)
    assert ZONE_RULE in str(caught.value)
    with pytest.raises(ConfigError, match="zone") as refused:
        load_server_config(None, {"zone": zone}, environ={})
    assert ZONE_RULE in str(refused.value)


def test_no_zone_is_none() -> None:
    assert ServerConfig().zone is None


def test_a_front_ends_id_is_its_http_address_unless_given() -> None:
    assert frontend_id(ServerConfig(host="10.0.0.7", port=9000)) == "10.0.0.7:9000"
    assert frontend_id(ServerConfig(port=9000, frontend_id="fe-a")) == "fe-a"


@pytest.mark.parametrize("given", ["", "a b", "tab\there", "x" * 129, "bell\x07"])
def test_a_front_end_id_must_be_printable_without_whitespace_and_short(given: str) -> None:
    with pytest.raises(ValueError, match="front end id"):
        check_frontend_id(given)
    with pytest.raises(ConfigError, match="frontend_id"):
        load_server_config(None, {"frontend_id": given}, environ={})


def test_a_front_end_id_of_128_printable_characters_is_taken() -> None:
    assert check_frontend_id("h" * 120 + ":8000:ab") == "h" * 120 + ":8000:ab"


def test_hello_of_an_older_worker_decodes_without_a_zone() -> None:
    class OldHello(msgspec.Struct, tag="hello"):
        worker_id: str
        model: str
        pid: int
        host: str

    frame = msgspec.msgpack.encode(OldHello("w", "sim", 1, "h"))
    hello = msgspec.msgpack.decode(frame, type=p.Message)
    assert isinstance(hello, p.Hello) and hello.zone is None


async def hello_answer(path: Path, hello: p.Hello) -> p.Welcome:
    reader, writer = await p.open_connection(f"unix:{path}", None)
    try:
        writer.write(p.encode_frame(hello))
        welcome = await asyncio.wait_for(p.read_message(reader), 30)
        assert isinstance(welcome, p.Welcome)
        return welcome
    finally:
        writer.close()


async def test_a_worker_of_another_protocol_is_refused_naming_both_protocols(tmp_path: Path) -> None:
    clock = FakeClock()
    directory = WorkerDirectory(clock)
    hub = WorkerHub(built(directory, sim_config()), clock, directory)
    await hub.listen_unix(str(tmp_path / "w.sock"))
    try:
        for other in (p.PROTOCOL_VERSION - 1, p.PROTOCOL_VERSION + 1):
            hello = p.Hello(worker_id="old", model="sim", pid=1, host="h", protocol=other)
            welcome = await hello_answer(tmp_path / "w.sock", hello)
            assert not welcome.accepted
            assert f"worker protocol {other} is not supported" in welcome.reason
            assert f"speaks protocol {p.PROTOCOL_VERSION}" in welcome.reason
        assert directory.connections() == [] and directory.handshaking() == 0
    finally:
        await hub.close()


async def test_a_worker_with_an_odd_zone_is_refused_and_one_with_a_zone_shows_it(tmp_path: Path) -> None:
    clock = FakeClock()
    directory = WorkerDirectory(clock)
    registry = built(directory, sim_config())
    hub = WorkerHub(registry, clock, directory)
    path = tmp_path / "w.sock"
    await hub.listen_unix(str(path))
    try:
        odd = await hello_answer(path, p.Hello(worker_id="w0", model="sim", pid=1, host="h", zone="Zone_A"))
        assert not odd.accepted and "not a DNS label" in odd.reason and ZONE_RULE in odd.reason

        reader, writer = await p.open_connection(f"unix:{path}", None)
        writer.write(p.encode_frame(p.Hello(worker_id="w1", model="sim", pid=1, host="h", zone="zone-a")))
        assert (await asyncio.wait_for(p.read_message(reader), 30)).accepted  # type: ignore[union-attr]
        writer.write(p.encode_frame(p.Ready(1, 0.0, 0.0)))
        await until(directory, "sim", 1, lambda: directory.workers("sim", 1))
        stats = registry.get("sim", 1).statistics()
        (w,) = stats.workers
        assert worker_row(stats, w, clock.now(), 0, BATCH_ADMIN)["zone"] == "zone-a"

        reader2, writer2 = await p.open_connection(f"unix:{path}", None)
        writer2.write(p.encode_frame(p.Hello(worker_id="w2", model="sim", pid=1, host="h")))
        assert (await asyncio.wait_for(p.read_message(reader2), 30)).accepted  # type: ignore[union-attr]
        writer2.write(p.encode_frame(p.Ready(1, 0.0, 0.0)))
        await until(directory, "sim", 1, lambda: len(directory.workers("sim", 1)) == 2)
        stats = registry.get("sim", 1).statistics()
        zones = {w.worker_id: worker_row(stats, w, clock.now(), 0, BATCH_ADMIN)["zone"] for w in stats.workers}
        assert zones == {"w1": "zone-a", "w2": None}
        writer.close()
        writer2.close()
    finally:
        await hub.close()


def test_an_odd_worker_zone_is_refused_at_start_naming_the_rule() -> None:
    from typer.testing import CliRunner

    from inferd.cli.main import app
    from inferd.worker.args import arguments

    args = ["worker", "--connect", "127.0.0.1:9", "--model", "sim", "--zone", "Zone_A"]
    result = CliRunner().invoke(app, args, env={"INFERD_JOIN_TOKEN": "t", "COLUMNS": "200"})
    assert result.exit_code == 2
    assert "--zone" in result.output and ZONE_RULE in result.output
    with pytest.raises(SystemExit) as refused:
        arguments().parse_args(["--connect", "127.0.0.1:9", "--model", "sim", "--zone", "Zone_A"])
    assert refused.value.code == 2
    assert arguments().parse_args(["--connect", "a:1", "--model", "m", "--zone", "zone-a"]).zone == "zone-a"


def test_the_admin_address_others_forward_to_is_one_they_can_reach() -> None:
    def cfg(admin_host: str, admin_port: int | None = 8001, frontend_id: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(admin_host=admin_host, admin_port=admin_port, frontend_id=frontend_id, host="0.0.0.0", port=8000)

    assert admin_address(cfg("10.0.0.5")) == "10.0.0.5:8001"
    assert admin_address(cfg("0.0.0.0", frontend_id="10.1.2.3:8000")) == "10.1.2.3:8001"  # Kubernetes: the pod's IP
    assert admin_address(cfg("127.0.0.1", admin_port=None)) is None  # no admin API
    with pytest.raises(ValueError, match="--admin-host"):
        admin_address(cfg("0.0.0.0"))  # every address, and the id names none either
    with pytest.raises(ValueError, match="fixed --admin-port"):
        admin_address(cfg("10.0.0.5", admin_port=0))
