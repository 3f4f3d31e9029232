"""The admin port rule (HTTP port + 1 unless set) and the start-up check that names the fix for a port
in use."""

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


def free_pair() -> int:
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no free pair of ports found")


def test_admin_port_is_the_http_port_plus_one_unless_set() -> None:
    assert ServerConfig().admin_port == 8001
    assert load_server_config(None, {"port": 9000}, environ={}).admin_port == 9001
    assert load_server_config(None, {"port": 9000, "admin_port": 7000}, environ={}).admin_port == 7000
    assert load_server_config(None, {"port": 0}, environ={}).admin_port == 0  # a free one, logged


def test_a_port_out_of_range_is_reported_once() -> None:
    with pytest.raises(ConfigError) as err:
        load_server_config(None, {"port": -1}, environ={})
    assert "port: " in str(err.value)
    assert "admin_port" not in str(err.value)  # its default is derived from the port: no second error


def test_tools_derive_the_admin_url_from_the_http_address() -> None:
    assert admin_url(None, None, None) == "http://127.0.0.1:8001"
    assert admin_url(None, "10.0.0.5", 9000) == "http://10.0.0.5:9001"
    assert admin_url("http://h:1234", None, None) == "http://h:1234"


@pytest.fixture
def admin_listening() -> Iterator[int]:
    """A port something listens on, whose port - 1 was free (the HTTP port of the server under test)."""
    for _ in range(100):
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            port = held.getsockname()[1]
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port - 1))
                except OSError:
                    continue
            held.listen()
            yield port
            return
    raise AssertionError("no listening port with a free port below it found")


def test_an_admin_port_in_use_is_refused_naming_the_fix(admin_listening: int) -> None:
    listening = admin_listening
    cfg = load_server_config(None, {"port": listening - 1}, environ={})
    with pytest.raises(ConfigError) as err:
        check_ports_free(cfg)
    assert f"admin port {listening} (the HTTP port {listening - 1} + 1)" in str(err.value)
    assert "--admin-port" in str(err.value) and "--no-admin" in str(err.value)
    check_ports_free(cfg.model_copy(update={"admin_port": None}))  # --no-admin starts
    check_ports_free(cfg.model_copy(update={"admin_port": 0}))  # --admin-port 0 starts


def test_an_http_port_in_use_is_refused_naming_the_fix(listening: int) -> None:
    cfg = load_server_config(None, {"port": listening, "admin_port": 0}, environ={})
    with pytest.raises(ConfigError, match=f"HTTP port {listening} .* in use.*another --port"):
        check_ports_free(cfg)


def test_free_ports_pass_and_one_port_for_both_apis_does_not() -> None:
    port = free_pair()
    check_ports_free(load_server_config(None, {"port": port}, environ={}))
    with pytest.raises(ConfigError, match="both"):
        check_ports_free(load_server_config(None, {"port": port, "admin_port": port}, environ={}))


def test_serve_help_states_the_admin_port_rule_and_the_grace_period() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "HTTP port + 1" in result.output
    assert "--shutdown-grace-s" in result.output
