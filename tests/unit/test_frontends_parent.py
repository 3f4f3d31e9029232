"""The parent of `inferd serve --frontends N` (runner/parent.py): a stop signal that arrives while a
front end is being started reaches that front end too; the HTTP and gRPC ports it holds (free ones picked
once for port 0) are the ones every front end gets, and their listeners share them."""

from __future__ import annotations

import errno
import signal
import socket
from types import SimpleNamespace

import pytest

from inferd.config import load_server_config
from inferd.runner import parent
from inferd.runner.parent import Frontends, reuseport_socket, shared_ports


class Process:
    """A front end's process that is started when the server is told to stop."""

    def __init__(self, target: object, args: object, daemon: bool) -> None:
        self.pid: int | None = None

    def start(self) -> None:
        self.pid = 4242
        signal.raise_signal(signal.SIGTERM)  # the operator stops the server during the fork

    def is_alive(self) -> bool:
        return True


def test_a_stop_signal_during_a_front_ends_start_reaches_it(monkeypatch: pytest.MonkeyPatch) -> None:
    signalled: list[tuple[int, int]] = []
    monkeypatch.setattr(parent.os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    frontends = Frontends.__new__(Frontends)
    frontends.context = SimpleNamespace(Process=Process)
    frontends.plan = SimpleNamespace(at=lambda index: index)
    frontends.cfg = frontends.models = frontends.holder = frontends.grpc_holder = frontends.store = None
    frontends.procs = {}
    frontends.stopping = False
    previous = signal.signal(signal.SIGTERM, frontends._forward)
    try:
        frontends._start(1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert frontends.stopping
    assert signalled == [(4242, signal.SIGTERM)]  # else it runs on, and the parent waits for it forever


def test_the_front_ends_get_the_ports_the_parent_holds_and_share_them() -> None:
    cfg = load_server_config(None, {"port": 0, "frontends": 2}, environ={})
    assert cfg.grpc_port == 0  # a free one, to be picked once for all front ends
    with reuseport_socket(cfg.host, cfg.port) as http, reuseport_socket(cfg.host, cfg.grpc_port) as grpc:
        shared = shared_ports(cfg, http, grpc)
        assert (shared.port, shared.grpc_port) == (http.getsockname()[1], grpc.getsockname()[1])
        assert shared.port != shared.grpc_port
        for port in (shared.port, shared.grpc_port):
            with reuseport_socket(cfg.host, port) as a, reuseport_socket(cfg.host, port) as b:
                a.listen()  # two front ends' listeners on the held port, as grpcio's with so_reuseport
                b.listen()
            with socket.socket() as plain, pytest.raises(OSError) as err:
                plain.bind((cfg.host, port))  # a plain socket (no SO_REUSEADDR or SO_REUSEPORT) cannot take it
            assert err.value.errno == errno.EADDRINUSE
        off = shared_ports(cfg.model_copy(update={"grpc_port": None}), http, None)
        assert (off.port, off.grpc_port) == (shared.port, None)  # --no-grpc: none held, none served
