"""The parent of `inferd serve --frontends N` (runner/parent.py): a stop signal that arrives while a
front end is being started reaches that front end too."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from inferd.runner import parent
from inferd.runner.parent import Frontends


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
    frontends.cfg = frontends.models = frontends.holder = frontends.store = None
    frontends.procs = {}
    frontends.stopping = False
    previous = signal.signal(signal.SIGTERM, frontends._forward)
    try:
        frontends._start(1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert frontends.stopping
    assert signalled == [(4242, signal.SIGTERM)]  # else it runs on, and the parent waits for it forever
