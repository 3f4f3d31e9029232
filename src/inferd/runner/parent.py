"""`inferd serve --frontends N`: a small parent process runs N front ends on one port and restarts any
that dies.

* Each front end is a process of its own (forked) with its own event loop, its own listening socket
  bound with SO_REUSEPORT to the same address (the kernel spreads new connections over them), and its
  own worker socket; the local workers join every front end (`--connect` lists them all).
* Front end 0 is the owner: it runs the local workers (supervisor), the admin API, the autoscaler and
  rolling updates. The others serve requests only.
* A front end that dies takes only its own connections (and their requests) with it; the parent starts
  it again and the workers rejoin it. The owner's workers outlive it too (they go on serving the
  others): the parent is their subreaper (orphaned, they become its children and it reaps them), and
  the restarted owner adopts them (worker/survivors.py). Where the parent cannot be their subreaper
  (no prctl, no /proc), they exit with the owner as with one front end; and once the parent and the
  owner are both gone, they exit too (worker/orphans.py).
* SIGTERM, SIGINT and SIGHUP go to every front end; the parent exits once they all have, stopping any
  worker still there (one left by an owner that died while the server stopped).

The parent serves the store the front ends share (cluster/local.py) from a thread of its own, started
before the first front end: it outlives every front end's restart, so a restarted one finds the state.

The parent holds a socket bound to the port (never listening) so that the port stays the server's
while a front end restarts, and so that port 0 names one free port for all of them. The same for the
gRPC port: every front end serves the gRPC API on it too (SO_REUSEPORT, grpcio's `grpc.so_reuseport`,
which a single front end leaves off so that a second server on its port is refused), and with port 0
the parent picks it once and hands it to every front end in its config.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.process import BaseProcess
from types import FrameType

from inferd.clock import MonotonicClock
from inferd.cluster.config import open_store, store_url
from inferd.cluster.local import LocalStoreServer
from inferd.config import ConfigError, ModelConfig, ServerConfig
from inferd.frontends.plan import FrontendPlan

log = logging.getLogger("inferd.frontends")

RESTART_DELAY_S = 0.5
"""How long the parent waits before starting a front end that died again."""

REAP_EVERY = 10
"""Watch rounds (0.1 s each) between two looks for orphaned workers to reap."""

STRAY_GRACE_S = 5.0
"""How long workers left at exit get to drain after SIGTERM before SIGKILL."""

PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals the parent hands on to every front end."""


def become_subreaper() -> bool:
    """Orphaned descendants (the workers of an owner that died) become this process's children."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc: none found
        return []
    found = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT: every front end binds one, and the kernel
    spreads new connections over those listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def frontend_config(cfg: ServerConfig, index: int) -> ServerConfig:
    """Front end `index`'s settings: only the owner serves the admin API; each one's worker port (for
    workers on other hosts) is the configured one + its index."""
    if index == 0:
        return cfg
    worker_port = None if cfg.worker_port is None else cfg.worker_port + index
    return cfg.model_copy(update={"admin_port": None, "worker_port": worker_port})


class Frontends:
    def __init__(self, cfg: ServerConfig, models: list[ModelConfig]) -> None:
        self.socket_dir = tempfile.mkdtemp(prefix="inferd-")
        self.plan = FrontendPlan(0, cfg.frontends, self.socket_dir, secrets.token_hex(16))
        self.store = LocalStoreServer(self.plan.store_path(), self.plan.token, MonotonicClock())
        self.holder = reuseport_socket(cfg.host, cfg.port)
        self.grpc_holder = None if cfg.grpc_port is None else reuseport_socket(cfg.host, cfg.grpc_port)
        self.cfg = shared_ports(cfg, self.holder, self.grpc_holder)
        self.models = models
        self.context = multiprocessing.get_context("fork")
        self.procs: dict[int, BaseProcess] = {}
        self.stopping = False

    def run(self) -> int:
        grpc = "" if self.cfg.grpc_port is None else f", gRPC on port {self.cfg.grpc_port}"
        log.info(
            "%d front ends on %s:%d%s (owner: front end 0)", self.plan.count, self.cfg.host, self.cfg.port, grpc
        )
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        if become_subreaper() and os.path.isdir("/proc"):
            self.plan = dataclasses.replace(self.plan, parent_pid=os.getpid())
        else:
            log.warning("cannot become the workers' subreaper: the owner's workers exit with it")
        try:
            self.store.start()
            for index in range(self.plan.count):
                self._start(index)
            self._watch()
        finally:
            self._stop_strays()
            self.store.stop()
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.holder.close()
            if self.grpc_holder is not None:
                self.grpc_holder.close()
        return 0

    def _start(self, index: int) -> None:
        proc = self.context.Process(
            target=_serve,
            args=(self.cfg, self.models, self.plan.at(index), self.holders(), self.store),
            daemon=False,
        )
        # Blocked across the fork: a signal that lands before the child resets its handlers waits for
        # it (the default action), rather than running the parent's handler in the child; and the
        # parent's handler, run once unblocked, finds the new front end among those it signals.
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        try:
            proc.start()
            self.procs[index] = proc
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        log.info("front end %d started (pid %s)", index, proc.pid)

    def holders(self) -> list[socket.socket]:
        """The parent's sockets that hold the shared ports (a front end closes its copies)."""
        return [self.holder] + ([self.grpc_holder] if self.grpc_holder is not None else [])

    def _watch(self) -> None:
        died_at: dict[int, float] = {}
        rounds = 0
        while self.procs:
            time.sleep(0.1)
            rounds += 1
            if rounds % REAP_EVERY == 0:
                self._reap()
            for index, proc in list(self.procs.items()):
                if proc.is_alive():
                    continue
                del self.procs[index]
                if self.stopping:
                    continue
                log.warning(
                    "front end %d (pid %s) exited with %s; starting it again", index, proc.pid, proc.exitcode
                )
                now = time.monotonic()
                if now - died_at.get(index, -RESTART_DELAY_S * 10) < RESTART_DELAY_S * 10:
                    time.sleep(RESTART_DELAY_S)  # dying over and over: do not spin
                died_at[index] = now
                self._start(index)

    def _strays(self) -> list[int]:
        """Children that are not front ends: workers adopted from an owner that died."""
        ours = {proc.pid for proc in self.procs.values()}
        return [pid for pid in children(os.getpid()) if pid not in ours]

    def _reap(self) -> list[int]:
        """Collect the strays that exited; returns those still running."""
        left = []
        for pid in self._strays():
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    left.append(pid)
        return left

    def _stop_strays(self) -> None:
        """At exit: SIGTERM the workers still here, SIGKILL them after STRAY_GRACE_S."""
        left = self._reap()
        if not left:
            return
        log.warning("stopping %d worker(s) left by an owner that died: %s", len(left), left)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + STRAY_GRACE_S
            while left and time.monotonic() < deadline:
                time.sleep(0.05)
                left = self._reap()
            if not left:
                return

    def _forward(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGHUP:
            self.stopping = True
        for proc in self.procs.values():
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, sig)


def shared_ports(cfg: ServerConfig, http: socket.socket, grpc: socket.socket | None) -> ServerConfig:
    """The front ends' settings: the HTTP and gRPC ports the parent holds (the ones picked for port 0)."""
    update = {"port": http.getsockname()[1]}
    if grpc is not None:
        update["grpc_port"] = grpc.getsockname()[1]
    return cfg.model_copy(update=update)


def _serve(
    cfg: ServerConfig, models: list[ModelConfig], plan: FrontendPlan, holders: list[socket.socket],
    store: LocalStoreServer,
) -> None:
    """A front end's process: its own socket on the shared port, then the server as with one. The
    parent's store is reached over its socket (plan.store_path()), not through the copies forked here."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    # until the server takes SIGHUP (a reload), one sent to every front end (`kill -HUP` of the parent)
    # must not end a front end still starting: its config is read after this anyway
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    for holder in holders:
        holder.close()
    store.close_inherited()
    from inferd.runner import serve_frontend

    sock = reuseport_socket(cfg.host, cfg.port)
    serve_frontend(frontend_config(cfg, plan.index), models, plan, sock)


def run_frontends(cfg: ServerConfig, models: list[ModelConfig]) -> int:
    from inferd.runner import log_config

    log_config(cfg, models)
    if store_url(cfg) is not None:  # a shared store that fails its PING: refused once, not per front end
        try:
            asyncio.run(_reachable(cfg))
        except ConfigError as exc:
            log.error("%s", exc)
            return 2
    return Frontends(cfg, models).run()


async def _reachable(cfg: ServerConfig) -> None:
    store = await open_store(cfg)
    if store is not None:
        await store.close()
