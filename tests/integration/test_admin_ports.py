"""The default port rule with real `inferd serve` processes: the gRPC API is on the HTTP port + 1 and the
admin API on the HTTP port + 2 unless --grpc-port and --admin-port say otherwise, so servers whose HTTP
ports are 3 apart on one host both start, the tools find each one's admin API from its HTTP port, and a
port in use is refused at start with the fix."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import ROOT, ServerProc, free_port, start_server


def grpc_serving(target: str) -> bool:
    """Whether grpc.health.v1 at `target` answers SERVING for the server (service "")."""
    with grpc.insecure_channel(target) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def port_triple() -> int:
    """A free port whose next two ports are free too (an HTTP port for the default gRPC and admin rule)."""
    for _ in range(100):
        port = free_port()
        if port < 65534:
            with socket.socket() as a, socket.socket() as b:
                try:
                    a.bind(("127.0.0.1", port + 1))
                    b.bind(("127.0.0.1", port + 2))
                except OSError:
                    continue
            return port
    raise AssertionError("no three free ports in a row found")


def serve_with_default_admin_port(tmp_path: Path, port: int) -> ServerProc:
    """`inferd serve --port PORT` without --admin-port or --grpc-port (conftest's start_server always
    sets both)."""
    log_path = tmp_path / f"server-{port}.log"
    serve = ["serve", "--port", str(port), "--model", "sim", "--shutdown-grace-s", "0"]
    serve += ["--data-dir", str(tmp_path / f"data-{port}")]  # each server its own data folder
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferd.cli.main", *serve],
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    server = ServerProc(proc, port, log_path, port + 2, port + 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(f"{server.url}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise AssertionError(f"server not ready within 60 s:\n{server.log()}")


def inferd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inferd.cli.main", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_two_servers_on_one_host_each_serve_an_admin_api_that_status_finds(tmp_path: Path) -> None:
    first = serve_with_default_admin_port(tmp_path, port_triple())
    try:
        second = serve_with_default_admin_port(tmp_path, port_triple())
        try:
            for server in (first, second):
                with urllib.request.urlopen(f"{server.admin_url}/admin/workers", timeout=5) as r:
                    workers = json.loads(r.read())["workers"]
                pids = {w["pid"] for w in workers}
                assert pids and pids <= set(server.worker_pids())  # this server's own workers
                status = inferd("status", "--port", str(server.port), "--json")
                assert status.returncode == 0, status.stderr
                page = json.loads(status.stdout)["workers"]
                assert {w["pid"] for w in page["workers"]} == pids
                assert page["grpc"] == f"127.0.0.1:{server.port + 1}"
                assert f"admin API on http://127.0.0.1:{server.port + 2}" in server.log()
                assert f"gRPC API on 127.0.0.1:{server.port + 1}" in server.log()
                assert grpc_serving(server.grpc_target)
        finally:
            assert second.stop() == 0
    finally:
        assert first.stop() == 0


def test_an_admin_port_in_use_is_refused_at_start_naming_the_fix(tmp_path: Path) -> None:
    port = port_triple()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 2))
        taken.listen()
        refused = inferd("serve", "--port", str(port), "--model", "sim")
        assert refused.returncode == 2
        assert f"admin port {port + 2} (the HTTP port {port} + 2)" in refused.stderr
        assert "--admin-port" in refused.stderr and "--no-admin" in refused.stderr
        assert "HTTP ports at least 3 apart" in refused.stderr
        assert "Traceback" not in refused.stderr
        server = start_server(tmp_path, "--port", str(port), "--no-admin", "--model", "sim")
        try:
            assert "admin API on" not in server.log()
        finally:
            assert server.stop() == 0


def test_a_grpc_port_in_use_is_refused_at_start_naming_the_fix(tmp_path: Path) -> None:
    port = port_triple()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        refused = inferd("serve", "--port", str(port), "--model", "sim")
        assert refused.returncode == 2
        assert f"gRPC port {port + 1} (the HTTP port {port} + 1) on 127.0.0.1 is in use" in refused.stderr
        assert "--grpc-port" in refused.stderr and "--no-grpc" in refused.stderr
        assert "HTTP ports at least 3 apart" in refused.stderr
        assert "Traceback" not in refused.stderr
        given = inferd("serve", "--port", "0", "--grpc-port", str(port + 1), "--model", "sim")
        assert given.returncode == 2
        assert f"gRPC port {port + 1} on 127.0.0.1 is in use" in given.stderr  # set, so not "the HTTP port + 1"
        server = start_server(tmp_path, "--port", str(port), "--no-grpc", "--model", "sim")
        try:
            assert "gRPC API on" not in server.log()
        finally:
            assert server.stop() == 0


def test_a_second_server_on_a_grpc_port_in_use_is_refused_at_start_naming_the_fix(tmp_path: Path) -> None:
    """The first server's gRPC port is its own (grpcio's so_reuseport is off for one front end): a second
    `inferd serve` given it stops before anything starts, and the first serves on."""
    first = start_server(tmp_path, "--model", "sim")
    try:
        assert grpc_serving(first.grpc_target)
        second = inferd(
            "serve", "--port", str(free_port()), "--grpc-port", str(first.grpc_port), "--admin-port", "0",
            "--model", "sim", "--data-dir", str(tmp_path / "second"),
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert f"gRPC port {first.grpc_port} on 127.0.0.1 is in use" in second.stderr
        assert "--grpc-port PORT (0: a free one), or --no-grpc" in second.stderr
        assert "Traceback" not in second.stderr
        assert grpc_serving(first.grpc_target)
    finally:
        assert first.stop() == 0


@pytest.mark.parametrize("frontends", [1, 2])
def test_port_0_gives_a_free_grpc_port_logged_and_shown_by_status(tmp_path: Path, frontends: int) -> None:
    """With --frontends 2 the parent picks the port once: both front ends listen on it."""
    log_path = tmp_path / "server.log"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "inferd.cli.main", "serve", "--port", "0", "--model", "sim",
            "--frontends", str(frontends), "--shutdown-grace-s", "0", "--data-dir", str(tmp_path / "data"),
        ],
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )  # fmt: skip
    server = ServerProc(proc, 0, log_path)
    try:
        deadline = time.monotonic() + 60
        grpc_ports: list[str] = []
        admin = None
        while len(grpc_ports) < frontends or admin is None:  # each front end logs its gRPC listener
            assert proc.poll() is None, server.log()
            assert time.monotonic() < deadline, f"no gRPC and admin addresses logged:\n{server.log()}"
            time.sleep(0.1)
            grpc_ports = re.findall(r"gRPC API on 127\.0\.0\.1:(\d+)", server.log())
            admin = re.search(r"admin API on (http://127\.0\.0\.1:\d+)", server.log())
        assert len(set(grpc_ports)) == 1, grpc_ports  # one port, shared by the front ends
        grpc_port, admin_url = int(grpc_ports[0]), admin[1]
        http = re.search(r"(?:running on http://127\.0\.0\.1:|front ends on 127\.0\.0\.1:)(\d+)", server.log())
        assert http is not None and 0 < grpc_port != int(http[1]), server.log()
        while not grpc_serving(f"127.0.0.1:{grpc_port}"):  # SERVING once the model's worker is ready
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        status = inferd("status", "--admin-url", admin_url, "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["workers"]["grpc"] == f"127.0.0.1:{grpc_port}"
        table = subprocess.run(
            [sys.executable, "-m", "inferd.cli.main", "status", "--admin-url", admin_url],
            capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip
        assert table.returncode == 0, table.stderr
        assert f"gRPC API on 127.0.0.1:{grpc_port}" in table.stdout
    finally:
        assert server.stop() == 0
