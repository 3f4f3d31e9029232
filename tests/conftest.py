"""Shared fixtures: real `inferd serve` processes on loopback, and a task/leak check for async tests."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    try:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        return []
    return [int(x) for x in out.stdout.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped between the kill(0) and the read (ESRCH)
        return False


@dataclass
class ServerProc:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    admin_port: int = 0
    grpc_port: int = 0

    @property
    def grpc_target(self) -> str:
        """HOST:PORT of its gRPC API, as grpc and tritonclient.grpc take it."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pids(self) -> list[int]:
        return child_pids(self.proc.pid)

    def stop(self, timeout_s: float = 30.0) -> int:
        workers = self.worker_pids()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"server did not stop within {timeout_s}s on SIGTERM") from None
        deadline = time.monotonic() + 5
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        orphans = [p for p in workers if alive(p)]
        for p in orphans:
            os.kill(p, signal.SIGKILL)
        assert not orphans, f"worker processes {orphans} outlived the server"
        return self.proc.returncode


def start_server(
    tmp_path: Path, *args: str, ready_timeout_s: float = 60.0, ready_path: str = "/v2/health/ready"
) -> ServerProc:
    port, admin_port, grpc_port = free_port(), free_port(), free_port()
    while admin_port in (port, port + 1):  # the kernel may hand the same free port out twice in a row
        admin_port = free_port()
    while grpc_port in (port, admin_port):
        grpc_port = free_port()
    if "--port" in args:  # a restarted server on the same port
        i = args.index("--port")
        port, args = int(args[i + 1]), args[:i] + args[i + 2 :]
    if "--data-dir" not in args:  # each server its own data folder (a second on one folder is refused)
        args = (*args, "--data-dir", str(tmp_path / f"data-{port}"))
    log_path = tmp_path / f"server-{port}.log"
    log_file = open(log_path, "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferd.cli.main",
            "serve",
            "--port",
            str(port),
            "--admin-port",
            str(admin_port),
            *(() if "--no-grpc" in args or "--grpc-port" in args else ("--grpc-port", str(grpc_port))),
            "--shutdown-grace-s",  # stop at once in teardown (a test may pass its own)
            "0",
            *args,
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    if "--grpc-port" in args:
        grpc_port = int(args[args.index("--grpc-port") + 1])
    server = ServerProc(proc, port, log_path, admin_port, 0 if "--no-grpc" in args else grpc_port)
    deadline = time.monotonic() + ready_timeout_s
    import urllib.request

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(f"{server.url}{ready_path}", timeout=1) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.05)
    server.stop()
    raise AssertionError(f"server not ready within {ready_timeout_s}s:\n{server.log()}")


@pytest.fixture
async def no_leftover_tasks() -> AsyncIterator[None]:
    """Every async test ends with no task of its own still running (added to each async test below)."""
    before = set(asyncio.all_tasks())
    yield
    for _ in range(10):  # tasks already cancelled get their last step
        await asyncio.sleep(0)
    current = asyncio.current_task()
    leftover = [t for t in asyncio.all_tasks() if t is not current and t not in before and not t.done()]
    assert not leftover, f"tasks left running after the test: {leftover}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and inspect.iscoroutinefunction(function):
            item.fixturenames.append("no_leftover_tasks")  # type: ignore[attr-defined]
