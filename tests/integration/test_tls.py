"""TLS end to end, with certificates from a throwaway CA (trustme) for 127.0.0.1 and localhost: one
`inferd serve --ssl-certfile --ssl-keyfile` with a worker port, its HTTP and admin APIs over HTTPS (the
openai client and tritonclient with the CA), plain HTTP and TLS 1.1 refused, and workers joining over TLS
with --ca-file (or the certificate as PEM text, as Ray actors do) while one with the wrong CA is refused."""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import pytest
import tritonclient.http as triton
import trustme

from inferd.models.sim import sim_digest
from inferd.wire import protocol as p
from tests.conftest import ROOT, ServerProc, free_port

TOKEN = "tls-join-secret"


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path
    other_ca: Path
    """A CA that signed nothing the server holds."""

    def context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


@dataclass
class TlsServer(ServerProc):
    worker_port: int = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"https://127.0.0.1:{self.admin_port}"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(d / "ca.pem")
    (d / "cert.pem").write_bytes(b"".join(b.bytes() for b in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(d / "key.pem")
    trustme.CA().cert_pem.write_to_path(d / "other-ca.pem")
    return Certs(d / "ca.pem", d / "cert.pem", d / "key.pem", d / "other-ca.pem")


def get(url: str, ctx: ssl.SSLContext, timeout_s: float = 5.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout_s, context=ctx) as r:
        return r.status, r.read()


@pytest.fixture(scope="module")
def server(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    port, admin_port, worker_port, grpc_port = free_port(), free_port(), free_port(), free_port()
    while len({port, admin_port, worker_port, grpc_port}) < 4:  # the kernel may hand one out twice
        admin_port, worker_port, grpc_port = free_port(), free_port(), free_port()
    log_path = tmp_path_factory.mktemp("tls") / "server.log"
    serve = [
        *("serve", "--model", "sim", "--workers", "1", "--shutdown-grace-s", "0"),
        *("--port", str(port), "--admin-port", str(admin_port), "--worker-port", str(worker_port)),
        *("--grpc-port", str(grpc_port)),
        *("--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key)),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferd.cli.main", *serve],
        env={**os.environ, "INFERD_JOIN_TOKEN": TOKEN},
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    s = TlsServer(proc, port, log_path, admin_port=admin_port, grpc_port=grpc_port, worker_port=worker_port)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{s.log()}")
        try:
            if get(f"{s.url}/v2/health/ready", certs.context(), 1)[0] == 200:
                break
        except OSError:
            if time.monotonic() > deadline:
                s.stop()
                raise AssertionError(f"server not ready over HTTPS within 60 s:\n{s.log()}") from None
            time.sleep(0.05)
    try:
        yield s
    finally:
        assert s.stop() == 0, s.log()


def admin_workers(server: TlsServer, certs: Certs) -> list[dict]:
    return json.loads(get(f"{server.admin_url}/admin/workers", certs.context())[1])["workers"]


def start_worker(server: TlsServer, tmp: Path, worker_id: str, *tls_args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "inferd.worker.main", "--connect", f"127.0.0.1:{server.worker_port}"),
            *("--model", "sim", "--token", TOKEN, "--worker-id", worker_id, *tls_args),
        ],
        stdout=open(tmp / f"{worker_id}.log", "wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


def test_openai_client_and_tritonclient_work_over_https_with_the_ca(server: TlsServer, certs: Certs) -> None:
    http_client = openai.DefaultHttpxClient(verify=certs.context())
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, http_client=http_client
    )
    assert "sim" in {m.id for m in client.models.list()}
    with pytest.raises(openai.BadRequestError, match="does not produce embeddings"):
        client.embeddings.create(model="sim", input="x")
    http_client.close()

    triton_client = triton.InferenceServerClient(
        f"127.0.0.1:{server.port}", ssl=True, ssl_options={"ca_certs": str(certs.ca)}
    )
    inp = triton.InferInput("INPUT0", [1], "BYTES")
    inp.set_data_from_numpy(np.array([b"over tls"], dtype=object))
    result = triton_client.infer("sim", [inp])
    assert result.as_numpy("OUTPUT0")[0].decode() == sim_digest("sim", 1, "over tls")
    triton_client.close()


def test_plaintext_to_the_tls_ports_fails(server: TlsServer) -> None:
    for port in (server.port, server.admin_port):
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=5)
    with socket.create_connection(("127.0.0.1", server.worker_port), timeout=5) as sock:
        hello = p.Hello(worker_id="plain", model="sim", pid=1, host="h", token=TOKEN, version=0)
        sock.sendall(p.encode_frame(hello))
        try:
            answer = sock.recv(4096)
        except ConnectionResetError:
            answer = b""
    assert answer == b"" or answer[0] == 0x15, f"a TLS alert or nothing, never a welcome: {answer!r}"


def tls_1_1_client() -> ssl.SSLContext:
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.check_hostname, old.verify_mode = False, ssl.CERT_NONE
    old.set_ciphers("DEFAULT:@SECLEVEL=0")  # let this client offer TLS 1.1 at all
    with warnings.catch_warnings(category=DeprecationWarning, action="ignore"):
        old.minimum_version = ssl.TLSVersion.TLSv1
        old.maximum_version = ssl.TLSVersion.TLSv1_1
    return old


def handshake(port: int, client: ssl.SSLContext) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with client.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return tls.version() or ""


def test_tls_1_1_is_refused_by_every_port(server: TlsServer, certs: Certs) -> None:
    # the control: this client does speak TLS 1.1 to a server that allows it
    permissive = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    permissive.load_cert_chain(certs.cert, certs.key)
    permissive.set_ciphers("DEFAULT:@SECLEVEL=0")
    with warnings.catch_warnings(category=DeprecationWarning, action="ignore"):
        permissive.minimum_version = ssl.TLSVersion.TLSv1
    with socket.create_server(("127.0.0.1", 0)) as listener:
        accepting = threading.Thread(target=accept_one, args=(listener, permissive))
        accepting.start()
        assert handshake(listener.getsockname()[1], tls_1_1_client()) == "TLSv1.1"
        accepting.join(5)
    for port in (server.port, server.admin_port, server.worker_port):
        with pytest.raises(ssl.SSLError):  # an alert (protocol version), or the connection closed
            handshake(port, tls_1_1_client())
        assert handshake(port, certs.context()) in ("TLSv1.2", "TLSv1.3")


def accept_one(listener: socket.socket, ctx: ssl.SSLContext) -> None:
    conn, _ = listener.accept()
    with ctx.wrap_socket(conn, server_side=True):
        pass


def test_admin_api_serves_over_tls(server: TlsServer, certs: Certs) -> None:
    workers = admin_workers(server, certs)
    assert [w["model"] for w in workers] == ["sim"]
    assert f"admin API on https://127.0.0.1:{server.admin_port}" in server.log()
    status = subprocess.run(  # the tools: --admin-url https://..., the CA from SSL_CERT_FILE
        [sys.executable, "-m", "inferd.cli.main", "status", "--admin-url", server.admin_url, "--json"],
        env={**os.environ, "SSL_CERT_FILE": str(certs.ca)},
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert status.returncode == 0, status.stderr
    assert [w["model"] for w in json.loads(status.stdout)["workers"]["workers"]] == ["sim"]


def test_workers_join_over_tls_with_the_ca_file_or_the_pinned_certificate(
    server: TlsServer, certs: Certs, tmp_path: Path
) -> None:
    workers = [
        start_worker(server, tmp_path, "remote-ca", "--ca-file", str(certs.ca)),
        start_worker(server, tmp_path, "remote-pem", "--ca-pem", certs.cert.read_text()),
    ]
    try:
        for _ in range(600):
            ready = {w["worker_id"] for w in admin_workers(server, certs) if w["state"] == "ready"}
            if {"remote-ca", "remote-pem"} <= ready:
                break
            assert all(w.poll() is None for w in workers), [f.read_text() for f in tmp_path.glob("*.log")]
            time.sleep(0.05)
        else:
            raise AssertionError(f"remote workers not ready over TLS:\n{server.log()[-3000:]}")
    finally:
        for w in workers:
            w.terminate()
            w.wait(10)


def test_worker_with_the_wrong_ca_is_refused_and_the_server_stays_healthy(
    server: TlsServer, certs: Certs, tmp_path: Path
) -> None:
    worker = start_worker(server, tmp_path, "wrong-ca", "--ca-file", str(certs.other_ca), "--reconnect")
    try:
        assert worker.wait(20) == 2, "a worker that cannot trust the server stops: retrying cannot help"
    finally:
        if worker.poll() is None:
            worker.kill()
    log = (tmp_path / "wrong-ca.log").read_text()
    assert "is not trusted" in log and "--ca-file" in log, log
    assert get(f"{server.url}/v2/health/ready", certs.context())[0] == 200
    assert "wrong-ca" not in {w["worker_id"] for w in admin_workers(server, certs)}


def test_serve_refuses_half_a_pair_and_plain_joins_off_loopback_at_start(certs: Certs) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "inferd.cli.main", "serve", "--model", "sim", "--port", "0", *args],
            env={**os.environ, "INFERD_JOIN_TOKEN": TOKEN},
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )

    half = serve("--ssl-certfile", str(certs.cert))
    assert half.returncode == 2 and "pass --ssl-keyfile too" in half.stderr, half.stderr
    plain = serve("--worker-port", str(free_port()), "--worker-host", "0.0.0.0")
    assert plain.returncode == 2, plain.stderr
    assert "plain TCP" in plain.stderr and "--ssl-certfile" in plain.stderr and "--insecure" in plain.stderr
