"""TLS for the server's listeners (HTTP API, admin API, worker port) and for workers joining over TCP,
and the rule for when a join token may cross plain TCP.

Every context here speaks TLS 1.2 or newer only. A worker verifies the server against its `--ca-file`
(or the PEM text a Ray actor is given), with the host it connects to checked against the certificate's
subjectAltNames. A certificate in that file is trusted as it is (partial-chain verification), so a
worker can pin the server's own certificate instead of a CA.

A join token crosses plain TCP only on loopback, or where both sides said `--insecure`
(`plain_join_allowed`); anywhere else both sides refuse at start, naming the fix.
"""

from __future__ import annotations

import ipaddress
import ssl
from pathlib import Path
from typing import Any

from inferd.config import ConfigError, ServerConfig

MIN_VERSION = ssl.TLSVersion.TLSv1_2
CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20"
"""TLS 1.2 suites with forward secrecy and an AEAD; TLS 1.3 has its own (all of them are fine)."""


def is_loopback(host: str) -> bool:
    """'localhost', 127.0.0.0/8 or ::1. A name other than localhost is not resolved: it counts as remote."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plain_join_allowed(host: str, *, tls: bool, insecure: bool) -> bool:
    """Whether a join token may be exchanged with `host` (the worker port's listening address, or the
    address a worker connects to): over TLS always; over plain TCP on loopback, or when `--insecure`."""
    return tls or insecure or is_loopback(host)


def _readable(path: Path, what: str) -> None:
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{what} {path}: cannot read it ({exc.strerror or exc}): pass a readable PEM file"
        ) from None


def server_context(
    certfile: Path, keyfile: Path, flags: str = "--ssl-certfile/--ssl-keyfile"
) -> ssl.SSLContext:
    """A TLS >= 1.2 server context with this certificate (chain) and key; ConfigError naming the fix when
    a file is missing, unreadable, or not a matching PEM certificate and key."""
    cert_flag, key_flag = flags.split("/")
    _readable(certfile, f"{cert_flag} (certificate)")
    _readable(keyfile, f"{key_flag} (private key)")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSION
    ctx.set_ciphers(CIPHERS)
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{cert_flag} {certfile} and {key_flag} {keyfile} are not a PEM certificate and its private "
            f"key ({exc.reason or exc}): pass the certificate (chain) and the key it was issued for"
        ) from None
    return ctx


def client_context(ca_file: Path | None = None, ca_pem: str = "") -> ssl.SSLContext:
    """A worker's TLS >= 1.2 context that trusts only `ca_file` (or the PEM text `ca_pem`), with the
    hostname checked; ConfigError naming the fix when the CA cannot be read."""
    try:
        if ca_file is not None:
            _readable(ca_file, "--ca-file")
            ctx = ssl.create_default_context(cafile=str(ca_file))
        else:
            ctx = ssl.create_default_context(cadata=ca_pem)
    except ssl.SSLError as exc:
        where = f"--ca-file {ca_file}" if ca_file is not None else "the CA given as PEM text"
        raise ConfigError(
            f"{where} holds no usable PEM certificate ({exc.reason or exc}): pass the CA certificate "
            "that signed the server's certificate (or that certificate itself)"
        ) from None
    ctx.minimum_version = MIN_VERSION
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return ctx


def http_context(cfg: ServerConfig) -> ssl.SSLContext | None:
    """The HTTP and admin APIs' context (None: plain HTTP)."""
    if cfg.ssl_certfile is None or cfg.ssl_keyfile is None:
        return None
    return server_context(cfg.ssl_certfile, cfg.ssl_keyfile)


def worker_cert(cfg: ServerConfig) -> tuple[Path, Path, str] | None:
    """The worker port's certificate and key, with the flags that set them: its own pair, else the
    HTTP API's (None: plain TCP)."""
    if cfg.worker_ssl_certfile is not None and cfg.worker_ssl_keyfile is not None:
        return cfg.worker_ssl_certfile, cfg.worker_ssl_keyfile, "--worker-ssl-certfile/--worker-ssl-keyfile"
    if cfg.ssl_certfile is not None and cfg.ssl_keyfile is not None:
        return cfg.ssl_certfile, cfg.ssl_keyfile, "--ssl-certfile/--ssl-keyfile"
    return None


def worker_port_context(cfg: ServerConfig) -> ssl.SSLContext | None:
    """The worker port's context (None: plain TCP, allowed on a loopback worker_host or with
    --insecure); ConfigError naming the fix when a token would cross plain TCP off loopback."""
    pair = worker_cert(cfg)
    if pair is None:
        if not plain_join_allowed(cfg.worker_host, tls=False, insecure=cfg.insecure):
            raise ConfigError(
                f"the worker port on {cfg.worker_host} (not loopback) would take join tokens over plain "
                "TCP: pass --ssl-certfile/--ssl-keyfile (or --worker-ssl-certfile/--worker-ssl-keyfile), "
                "or --insecure on a network you trust (workers then need --insecure too)"
            )
        return None
    return server_context(*pair)


def worker_ca_pem(cfg: ServerConfig) -> str:
    """The PEM text Ray worker actors verify the worker port with ("" without TLS there): the worker
    port's own certificate (chain), trusted as it is, so the actors need no file of their own."""
    pair = worker_cert(cfg)
    if pair is None:
        return ""
    try:
        return pair[0].read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{pair[2].split('/')[0]} {pair[0]}: cannot read it ({exc}): pass a PEM file"
        ) from None


def check_server_tls(cfg: ServerConfig) -> None:
    """Everything TLS the server will need, checked before it starts: its files and the plain-TCP rule
    (for the worker port, and the port Ray actors join over)."""
    http_context(cfg)
    if cfg.worker_port is not None or cfg.ray_address:
        worker_port_context(cfg)
        if cfg.ray_address:
            pem = worker_ca_pem(cfg)
            if pem:
                client_context(ca_pem=pem)


def check_worker_transport(address: str, host: str, tls: bool, insecure: bool) -> None:
    """A worker's side of the rule: ConfigError naming the fix when it would send its token over plain
    TCP to a host that is not loopback."""
    if not plain_join_allowed(host, tls=tls, insecure=insecure):
        raise ConfigError(
            f"--connect {address}: {host} is not loopback and the join token would cross plain TCP: pass "
            "--ca-file with the CA of the server's certificate (served with --ssl-certfile), or --insecure "
            "when the server was started with --insecure on a network you trust"
        )


def uvicorn_options(cfg: ServerConfig) -> dict[str, Any]:
    """uvicorn.Config's TLS arguments for the HTTP API ({}: plain HTTP). uvicorn builds its context with
    ssl.SSLContext(PROTOCOL_TLS_SERVER), whose minimum is TLS 1.2 on Python >= 3.10."""
    if cfg.ssl_certfile is None or cfg.ssl_keyfile is None:
        return {}
    return {
        "ssl_certfile": str(cfg.ssl_certfile),
        "ssl_keyfile": str(cfg.ssl_keyfile),
        "ssl_ciphers": CIPHERS,
    }
