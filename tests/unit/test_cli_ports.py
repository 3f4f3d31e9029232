"""The default port rule (gRPC on the HTTP port + 1, admin on + 2, unless set) and the start-up check
that names the fix for a port in use."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from inferd.cli.main import app
from inferd.cli.ports import admin_url, check_ports_free
from inferd.config import ConfigError, ServerConfig, load_server_config


@pytest.fixture
def listening() -> Iterator[int]:
    """A port something listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def free_triple() -> int:
    """A free port whose next two ports are free too (an HTTP port for the default gRPC and admin rule)."""
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b, socket.socket() as c:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
                c.bind(("127.0.0.1", port + 2))
            except OSError:
                continue
            return port
    raise AssertionError("no three free ports in a row found")


def test_grpc_is_the_http_port_plus_one_and_admin_plus_two_unless_set() -> None:
    cfg = ServerConfig()
    assert (cfg.port, cfg.grpc_port, cfg.admin_port) == (8000, 8001, 8002)
    cfg = load_server_config(None, {"port": 9000}, environ={})
    assert (cfg.grpc_port, cfg.admin_port) == (9001, 9002)
    cfg = load_server_config(None, {"port": 9000, "admin_port": 7000, "grpc_port": 7001}, environ={})
    assert (cfg.grpc_port, cfg.admin_port) == (7001, 7000)
    cfg = load_server_config(None, {"port": 0}, environ={})
    assert (cfg.grpc_port, cfg.admin_port) == (0, 0)  # free ones, logged


def test_a_port_out_of_range_is_reported_once() -> None:
    with pytest.raises(ConfigError) as err:
        load_server_config(None, {"port": -1}, environ={})
    assert "port: " in str(err.value)
    assert "admin_port" not in str(err.value)  # its default is derived from the port: no second error


def test_tools_derive_the_admin_url_from_the_http_address() -> None:
    assert admin_url(None, None, None) == "http://127.0.0.1:8002"
    assert admin_url(None, "10.0.0.5", 9000) == "http://10.0.0.5:9002"
    assert admin_url("http://h:1234", None, None) == "http://h:1234"


def listening_above_free(offset: int) -> Iterator[int]:
    """A port something listens on, whose ports - 1 .. - offset were free (the HTTP port of the server
    under test is the lowest)."""
    for _ in range(100):
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            port = held.getsockname()[1]
            try:
                with socket.socket() as a, socket.socket() as b:
                    a.bind(("127.0.0.1", port - offset))
                    if offset == 2:
                        b.bind(("127.0.0.1", port - 1))
            except OSError:
                continue
            held.listen()
            yield port
            return
    raise AssertionError("no listening port with free ports below it found")


@pytest.fixture
def admin_listening() -> Iterator[int]:
    """A port something listens on, whose two ports below were free (HTTP and gRPC of the server under
    test)."""
    yield from listening_above_free(2)


@pytest.fixture
def grpc_listening() -> Iterator[int]:
    """A port something listens on, whose port - 1 was free (the HTTP port of the server under test)."""
    yield from listening_above_free(1)


def test_an_admin_port_in_use_is_refused_naming_the_fix(admin_listening: int) -> None:
    listening = admin_listening
    cfg = load_server_config(None, {"port": listening - 2, "grpc_port": 0}, environ={})
    with pytest.raises(ConfigError) as err:
        check_ports_free(cfg)
    assert f"admin port {listening} (the HTTP port {listening - 2} + 2)" in str(err.value)
    assert "--admin-port" in str(err.value) and "--no-admin" in str(err.value)
    assert "HTTP ports at least 3 apart" in str(err.value)
    check_ports_free(cfg.model_copy(update={"admin_port": None}))  # --no-admin starts
    check_ports_free(cfg.model_copy(update={"admin_port": 0}))  # --admin-port 0 starts


def test_a_grpc_port_in_use_is_refused_naming_the_fix(grpc_listening: int) -> None:
    listening = grpc_listening
    cfg = load_server_config(None, {"port": listening - 1, "admin_port": 0}, environ={})
    with pytest.raises(ConfigError) as err:
        check_ports_free(cfg)
    message = str(err.value)
    assert f"gRPC port {listening} (the HTTP port {listening - 1} + 1)" in message
    assert "--grpc-port" in message and "--no-grpc" in message
    assert "HTTP ports at least 3 apart" in message
    check_ports_free(cfg.model_copy(update={"grpc_port": None}))  # --no-grpc starts
    check_ports_free(cfg.model_copy(update={"grpc_port": 0}))  # --grpc-port 0 starts
    given = load_server_config(None, {"port": 0, "grpc_port": listening}, environ={})
    with pytest.raises(ConfigError) as err:
        check_ports_free(given)
    assert f"gRPC port {listening} on 127.0.0.1 is in use" in str(err.value)  # set, not derived: no "+ 1"


def test_an_http_port_in_use_is_refused_naming_the_fix(listening: int) -> None:
    cfg = load_server_config(None, {"port": listening, "admin_port": 0, "grpc_port": 0}, environ={})
    with pytest.raises(ConfigError, match=f"HTTP port {listening} .* in use.*another --port.*3 apart"):
        check_ports_free(cfg)


def test_free_ports_pass_and_one_port_for_two_apis_does_not() -> None:
    port = free_triple()
    check_ports_free(load_server_config(None, {"port": port}, environ={}))
    with pytest.raises(ConfigError, match="HTTP port and the admin port are both"):
        check_ports_free(load_server_config(None, {"port": port, "admin_port": port}, environ={}))
    with pytest.raises(ConfigError, match=r"HTTP port and the gRPC port are both.*--grpc-port.*--no-grpc"):
        check_ports_free(load_server_config(None, {"port": port, "grpc_port": port}, environ={}))
    with pytest.raises(ConfigError, match=r"gRPC port and the admin port are both 7000: pass --grpc-port.*--admin-port"):
        check_ports_free(load_server_config(None, {"port": port, "grpc_port": 7000, "admin_port": 7000}, environ={}))
    free = load_server_config(None, {"port": 0}, environ={})  # port 0: free ones, never the same
    check_ports_free(free)
    check_ports_free(free.model_copy(update={"grpc_port": None, "admin_port": None}))


def test_serve_help_states_the_port_rule_and_the_grace_period() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    words = " ".join(result.output.replace("│", " ").split())  # rich wraps and boxes the text
    assert "gRPC listens on the HTTP port + 1 and the admin API on the HTTP port + 2" in words
    assert "HTTP ports at least 3 apart" in words
    assert "--grpc-port" in result.output and "--no-grpc" in result.output
    assert "--shutdown-grace-s" in result.output


@pytest.mark.parametrize("command", ["status", "drain", "scale", "update"])
def test_the_tools_say_where_they_find_the_admin_api(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    words = " ".join(result.output.replace("│", " ").split())
    assert "port + 2" in words and "port + 1" not in words
