"""What the benchmark scripts share to run servers under load: free loopback ports, server processes
started in their own session and always stopped (at the end of a `with`, on errors, on Ctrl-C and at
exit), `inferd serve` on a temporary model repository and config, and where results go.

Stopping a server: SIGTERM to it, up to `grace_s` for it to exit, then SIGTERM and, 5 s later, SIGKILL to
whatever is left of its process tree and session (workers of a killed server, a peer's helpers).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from procfs import cpu_ticks, in_session, process_tree

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / ".bench"
"""Results and server logs (git-ignored)."""

_SWEEP_WAIT_S = 5.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """Whether GET `url` answers 200 (False while nothing listens or on another status)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def inferd_command(subcommand: str, *args: str) -> list[str]:
    """`inferd SUBCOMMAND ARGS` run by this interpreter (the venv the benchmark runs in)."""
    return [sys.executable, "-m", "inferd.cli.main", subcommand, *args]


class ServerNotReady(RuntimeError):
    pass


@dataclass(frozen=True)
class Stopped:
    how: str
    """What happened to the server itself."""
    sigkilled: list[int]
    """Processes of its tree or session that had to be SIGKILLed."""


class ServerProcess:
    """A server (or worker) process a benchmark starts and always stops, in its own session so that it
    and everything it starts can be found and stopped. `with` starts it and waits until `ready()`."""

    def __init__(
        self,
        cmd: list[str],
        *,
        name: str,
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 120.0,
        poll_s: float = 0.1,
        grace_s: float = 15.0,
    ) -> None:
        self.cmd = cmd
        self.name = name
        self.log_path = log_path
        """Its stdout and stderr; None: this terminal's."""
        self.env = env
        self.ready_timeout_s, self.poll_s, self.grace_s = ready_timeout_s, poll_s, grace_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None
        """Seconds from start to ready, once `with` has waited for it."""
        self.stopped: Stopped | None = None
        self._seen: set[int] = set()

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc.pid

    def ready(self) -> bool:
        """Whether it serves yet; a plain process is ready once started."""
        return True

    def start(self) -> None:
        log = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "wb")  # the child keeps its own copy
        try:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=None if log is None else subprocess.STDOUT,
                env=None if self.env is None else {**os.environ, **self.env},
                start_new_session=True,
            )
        finally:
            if log is not None:
                log.close()
        _RUNNING.append(self)

    def wait_ready(self) -> float:
        """Poll `ready()` every poll_s; the seconds it took. Raises ServerNotReady when the process exits
        first or ready_timeout_s passes."""
        t0 = time.monotonic()
        last = ""
        while time.monotonic() - t0 < self.ready_timeout_s:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerNotReady(
                    f"{self.name} exited with {self.proc.returncode} before it was ready{self._log_note()}"
                )
            try:
                if self.ready():
                    self.pids()
                    return time.monotonic() - t0
            except (OSError, ValueError, KeyError, IndexError) as exc:
                last = f" ({exc!r})"
            time.sleep(self.poll_s)
        raise ServerNotReady(
            f"{self.name} not ready within {self.ready_timeout_s:g} s{last}{self._log_note()}"
        )

    def pids(self) -> set[int]:
        """It, its descendants and its session's processes, alive now."""
        found = process_tree(self.pid, self.pid)
        self._seen |= found
        return found

    def cpu_ticks(self) -> dict[int, int]:
        return cpu_ticks(self.pids())

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None:
            return ""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> Stopped:
        """Stop it and everything it started (see the module docstring); idempotent."""
        if self.stopped is not None or self.proc is None:
            return self.stopped or Stopped("never started", [])
        proc, session = self.proc, self.proc.pid
        with contextlib.suppress(ValueError):
            _RUNNING.remove(self)
        self.pids()
        how = "had already exited"
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.grace_s)
                how = f"stopped on SIGTERM (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                how = f"did not stop within {self.grace_s:g} s of SIGTERM"
        killed = self._sweep(session)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1)
        if killed:
            how += f"; SIGKILLed {len(killed)} process(es)"
        self.stopped = Stopped(how, killed)
        return self.stopped

    def _sweep(self, session: int) -> list[int]:
        """SIGTERM, then SIGKILL, what is left of the tree and session; the pids SIGKILLed."""
        killed: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = self._survivors(session)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            if sig == signal.SIGKILL:
                killed = sorted(left)
            deadline = time.monotonic() + _SWEEP_WAIT_S
            while time.monotonic() < deadline and self._survivors(session):
                time.sleep(0.1)
        if left := self._survivors(session):
            print(
                f"WARNING: {self.name}: processes still alive after SIGKILL: {sorted(left)}", file=sys.stderr
            )
        return killed

    def _survivors(self, session: int) -> set[int]:
        """Its session and tree now (the tree only while its own pid is not reaped, so never a reused
        pid's), plus any process seen before that is still in its session."""
        root = session if self.proc is not None and self.proc.returncode is None else None
        return process_tree(root, session) | in_session(self._seen, session)

    def _log_note(self) -> str:
        if self.log_path is None:
            return ""
        return f"; log: {self.log_path}\n{self.log_tail()}"

    def __enter__(self) -> Self:
        self.start()
        try:
            self.ready_s = self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class InferdServer(ServerProcess):
    """`inferd serve ARGS` on 127.0.0.1:`port` (a free one by default), with its config and model
    repository (model name -> model.toml text) written to a temporary folder it removes when stopped.
    Its gRPC and admin APIs on free ports too unless ARGS set them (--grpc-port / --no-grpc,
    --admin-port / --no-admin): never the HTTP port + 1 and + 2, which something else may hold.
    Ready when /v2/health/ready answers 200."""

    def __init__(
        self,
        *args: str,
        name: str,
        config: str | None = None,
        models: Mapping[str, str] | None = None,
        port: int | None = None,
        free_ports: bool = True,
        **kw: Any,
    ) -> None:
        """`free_ports=False`: no --grpc-port / --admin-port added (a tree older than them: the HTTP
        port's defaults, which the caller makes sure are free)."""
        self.tmp = tempfile.TemporaryDirectory(prefix=f"{name}.")
        base = Path(self.tmp.name)
        options = list(args)
        if config is not None:
            (base / "inferd.toml").write_text(config)
            options += ["--config", str(base / "inferd.toml")]
        self.repo = base / "models"
        """The model repository (empty unless `models` was given)."""
        for model, toml in (models or {}).items():
            (self.repo / model).mkdir(parents=True)
            (self.repo / model / "model.toml").write_text(toml)
        if models is not None:
            options += ["--model-repo", str(self.repo)]
        if "--data-dir" not in options:  # each server its own data folder (a second on one is refused)
            options += ["--data-dir", str(base / "data")]
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        table = tomllib.loads(config).get("server", {}) if config is not None else {}
        self.grpc_port = int(table.get("grpc_port", self.port + 1))
        """The gRPC API's port (0: none, --no-grpc)."""
        self.admin_port = int(table.get("admin_port", self.port + 2))
        """The admin API's port (0: none, --no-admin)."""
        if free_ports and "grpc_port" not in table:
            self.grpc_port = _option_port(options, "--grpc-port", "--no-grpc", self.port)
        if free_ports and "admin_port" not in table:
            self.admin_port = _option_port(options, "--admin-port", "--no-admin", self.port, self.grpc_port)
        host = _option(options, "--host") or "127.0.0.1"
        self.grpc_target = f"{host}:{self.grpc_port}"
        """HOST:PORT of its gRPC API, as grpc and tritonclient.grpc take it."""
        self.admin_url = f"http://{_option(options, '--admin-host') or '127.0.0.1'}:{self.admin_port}"
        super().__init__(inferd_command("serve", *options, "--port", str(self.port)), name=name, **kw)

    def ready(self) -> bool:
        return http_ok(f"{self.url}/v2/health/ready")

    def stop(self) -> Stopped:
        stopped = super().stop()
        self.tmp.cleanup()
        return stopped


def _option(options: list[str], flag: str) -> str | None:
    """The value `flag` has in `options` (`flag VALUE` or `flag=VALUE`), None when absent."""
    for i, option in enumerate(options):
        if option == flag and i + 1 < len(options):
            return options[i + 1]
        if option.startswith(f"{flag}="):
            return option.split("=", 1)[1]
    return None


def _option_port(options: list[str], flag: str, off: str, *taken: int) -> int:
    """The port `flag` gives in `options` (0 with `off`); else a free one other than `taken`, appended to
    `options` as `flag PORT`."""
    if off in options:
        return 0
    if (given := _option(options, flag)) is not None:
        return int(given)
    port = free_port()
    while port in taken:  # the kernel may hand the same free port out twice in a row
        port = free_port()
    options += [flag, str(port)]
    return port


_RUNNING: list[ServerProcess] = []


@atexit.register
def _stop_all() -> None:
    """Whatever a benchmark did not stop (an exception past its `with`, a forgotten process)."""
    while _RUNNING:
        server = _RUNNING.pop()
        stopped = server.stop()
        if stopped.sigkilled:
            print(f"{server.name}: SIGKILLed {stopped.sigkilled}", file=sys.stderr)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def interrupt_on(*signums: signal.Signals) -> None:
    """Unwind like Ctrl-C on these signals, so `finally` blocks and `with` exits stop the servers."""
    for signum in signums:
        signal.signal(signum, _interrupt)


RUN_FIELDS = (
    "ok",
    "errors",
    "mismatched",
    "latency_ms",
    "overhead_ms",
    "queue_ms",
    "compute_ms",
    "batch_size",
)
"""The `PhaseReport` fields the server benchmarks keep for each run, as they are."""


def run_fields(phase: Any, *more: str) -> dict[str, Any]:
    """`RUN_FIELDS` and `more` fields of a `PhaseReport`, by name."""
    return {name: getattr(phase, name) for name in RUN_FIELDS + more}


def write_json(path: Path, data: Any, indent: int = 1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent))
    return path


def cell(value: float | None, digits: int = 1) -> str:
    """A number for a markdown table: '-' for None, else with thousands separators."""
    return "-" if value is None else f"{value:,.{digits}f}"
