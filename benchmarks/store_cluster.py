"""What the shared-store benchmarks (store_outage.py, lease_handover.py) share: a redis-server they start
and stop themselves (no persistence, loopback), and `inferd serve` front ends on loopback addresses
(127.0.0.1, 127.0.0.2, ...), each with its own --port, --worker-port, --admin-port and --data-dir and
the same `--store redis://...`, `--config` file and INFERD_JOIN_TOKEN: one server, as on many hosts.

Every process is a harness.ServerProcess in its own session: stopped at the end of a `with`, on an
exception, on Ctrl-C or SIGTERM (harness.interrupt_on) and at exit, workers of a killed front end
included.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from harness import InferdServer, ServerProcess, free_port

JOIN_TOKEN = secrets.token_hex(16)
"""INFERD_JOIN_TOKEN of every front end of a run (workers on other hosts would need it)."""


def ping(port: int) -> bool:
    """Whether a redis-server answers PING on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisProcess(ServerProcess):
    """Debian's redis-server on 127.0.0.1:`port`, no persistence (started again, it is empty)."""

    def __init__(self, port: int, log_path: Path | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed: run scripts/setup --test (Debian's redis-server)")
        self.port = port
        cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        super().__init__(cmd, name=f"redis-server:{port}", log_path=log_path, ready_timeout_s=10.0, grace_s=5.0)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def ready(self) -> bool:
        return ping(self.port)


class Ports:
    """Free loopback ports, never the same one twice in a run."""

    def __init__(self) -> None:
        self.used: set[int] = set()

    def take(self) -> int:
        while (port := free_port()) in self.used:
            pass
        self.used.add(port)
        return port


class FrontEnd(InferdServer):
    """`inferd serve --model sim --workers W --store URL` on 127.0.0.`i+1`, its HTTP, admin and worker
    ports its own. Ready when /v2/health/ready answers 200 on its address."""

    def __init__(self, i: int, store_url: str, config: Path, ports: Ports, log_dir: Path, workers: int = 1) -> None:
        self.host = f"127.0.0.{i + 1}"
        port, self.admin_port, self.worker_port = ports.take(), ports.take(), ports.take()
        args = [
            "--host", self.host, "--admin-host", self.host, "--admin-port", str(self.admin_port),
            "--worker-host", self.host, "--worker-port", str(self.worker_port),
            "--store", store_url, "--config", str(config), "--model", "sim", "--workers", str(workers),
            "--shutdown-grace-s", "0", "--log-level", "INFO",
        ]  # fmt: skip
        super().__init__(
            *args, name=f"frontend-{i}@{self.host}:{port}", port=port, log_path=log_dir / f"frontend-{i}-{port}.log",
            env={"INFERD_JOIN_TOKEN": JOIN_TOKEN}, ready_timeout_s=90.0,
        )  # fmt: skip
        self.url = f"http://{self.host}:{port}"
        self.admin_url = f"http://{self.host}:{self.admin_port}"
        self.id = f"{self.host}:{port}"

    def metrics(self, timeout_s: float = 2.0) -> dict[str, float]:
        """Sample -> value of one /metrics scrape."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def gauge(self, name: str) -> float | None:
        """One unlabelled gauge, or None when /metrics does not answer."""
        try:
            return self.metrics().get(name)
        except (OSError, ValueError):
            return None

    def holds(self) -> bool:
        return self.gauge("inferd_cluster_lease_holder") == 1.0

    def store_up(self) -> float | None:
        return self.gauge("inferd_cluster_store_up")

    def post_admin(self, path: str, timeout_s: float = 30.0) -> tuple[int, dict[str, Any], float]:
        """POST the admin API: (status, JSON answer, seconds to answer); status 0 when nothing answered."""
        req = urllib.request.Request(f"{self.admin_url}{path}", data=b"", method="POST")
        t = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                status, body = r.status, r.read()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read()
        except OSError as exc:
            return 0, {"error": repr(exc)}, time.monotonic() - t
        took = time.monotonic() - t
        try:
            return status, json.loads(body), took
        except ValueError:
            return status, {"raw": body.decode(errors="replace")}, took

    def infer_status(self, key: str | None = None, timeout_s: float = 5.0) -> int:
        """The status of one `sim` infer request (0: no answer)."""
        body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["x"]}]})
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(f"{self.url}/v2/models/sim/infer", data=body.encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0


def cluster_config(lease_ttl_s: float | None = None, extra: str = "") -> str:
    """The config file every front end reads (the store itself comes from --store)."""
    table = "" if lease_ttl_s is None else f"[cluster]\nlease_ttl_s = {lease_ttl_s}\n"
    return table + extra


def wait_until(what: str, check: Any, timeout_s: float, poll_s: float = 0.05) -> float:
    """Poll `check()` until true; the seconds it took. Raises TimeoutError naming `what`."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)
    return time.monotonic() - t0
