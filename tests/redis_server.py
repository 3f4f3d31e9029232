"""A throwaway redis-server on loopback for the quota store's tests (scripts/setup --test installs
Debian's redis-server). No persistence, a free port, stopped at teardown. A missing redis-server fails
the test that needs it; it never skips."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.conftest import free_port

START_TIMEOUT_S = 10.0


def ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up (with a password: it asks for it)
    except OSError:
        return False


@dataclass
class RedisServer:
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    extra_args: tuple[str, ...] = ()
    """More redis-server arguments (e.g. --requirepass)."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed: run scripts/setup --test (it installs Debian's redis-server)"
            )
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *self.extra_args]
        self.proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ping(self.port):
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                pytest.fail(f"redis-server on port {self.port} exited with {self.proc.returncode}: {err}")
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"redis-server on port {self.port} did not answer PING in {START_TIMEOUT_S} s")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
