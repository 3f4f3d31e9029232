"""The `[server]` settings of inferd's listeners: the front door's limits on slow clients, connections
and admission (enforced by api/frontdoor.py), and TLS for the HTTP, admin and worker ports (tls.py).
ServerConfig inherits them, so they are plain `[server]` keys."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ListenerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    header_timeout_s: float = Field(default=10.0, gt=0.0, le=600.0)
    """Total time a client has to send a request head, counted from when the connection opens (first
    request) or from the first byte of the next request on a keep-alive connection; then 408 (or a plain
    close when nothing of the request came) and the connection closes. A total, not an idle timeout, so
    a client trickling one header line every few seconds is cut off too."""
    body_timeout_s: float = Field(default=60.0, gt=0.0, le=3600.0)
    """Total time a client has to send a request body once its head is complete; then 408 (when no
    response has started) and the connection closes."""
    max_header_bytes: int = Field(default=16 * 1024, ge=1024, le=1024**2)
    """Largest request head (request line and header lines); a larger one gets 431 and the connection
    closes."""
    max_header_count: int = Field(default=100, ge=8, le=10_000)
    """Most header lines in one request; more get 431."""
    max_connections: int = Field(default=4096, ge=1, le=1_000_000)
    """Most connections this front-end process holds open; the next ones are answered 429 with
    Retry-After and closed, without reaching the app."""
    max_connections_per_ip: int | None = Field(default=2048, ge=1, le=1_000_000)
    """Most open connections from one client address (None: no per-address cap); the next ones are
    answered 429 with Retry-After and closed. Behind a proxy every client shares its address: raise this
    to max_connections there."""
    keep_alive_timeout_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    """An idle keep-alive connection is closed after this long without a new request."""
    max_requests_per_connection: int | None = Field(default=None, ge=1, le=100_000_000)
    """After this many requests a connection's last response says Connection: close (None: no limit)."""
    admission_rate_per_s: float | None = Field(default=None, gt=0.0, le=10_000_000.0)
    """Requests per second the front end lets through to the app (a token bucket; None: no limit).
    Requests over it get 429 with an honest Retry-After as soon as their head is parsed, before the app
    runs and before their body is read: cheap enough that a flood past the process's own CPU is refused
    instead of queueing unseen in the kernel's accept queue."""
    admission_burst: int | None = Field(default=None, ge=1, le=10_000_000)
    """Requests admitted at once above the rate (the bucket's size; None: one second's worth)."""
    ssl_certfile: Path | None = None
    """PEM certificate (chain) of the HTTP and admin APIs (and of the worker port, unless it has its
    own); with ssl_keyfile, they speak TLS (1.2 or newer) only."""
    ssl_keyfile: Path | None = None
    """PEM private key of ssl_certfile."""
    worker_ssl_certfile: Path | None = None
    """PEM certificate (chain) of the worker port; None: ssl_certfile. It must name the address workers
    connect to (their --connect host, or worker_host for Ray actors) as a subjectAltName."""
    worker_ssl_keyfile: Path | None = None
    """PEM private key of worker_ssl_certfile. Ray worker actors trust worker_ssl_certfile (or ssl_certfile)
    itself, sent to each as PEM text."""
    insecure: bool = False
    """Let workers join with their token over plain TCP on a worker_host that is not loopback (only on a
    network you trust; the workers need --insecure too). Loopback never needs it."""

    @model_validator(mode="after")
    def _tls_pairs(self) -> ListenerSettings:
        """A certificate without its key (or a key without its certificate) is refused, naming the fix."""
        for cert, key in (("ssl_certfile", "ssl_keyfile"), ("worker_ssl_certfile", "worker_ssl_keyfile")):
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                given, missing = (cert, key) if getattr(self, key) is None else (key, cert)
                flag = "--" + missing.replace("_", "-")
                raise ValueError(
                    f"{given} is set without {missing}: pass {flag} too (TLS needs both), or neither"
                )
        return self

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> ListenerSettings:
        if self.admission_burst is not None and self.admission_rate_per_s is None:
            raise ValueError(
                "admission_burst is set without admission_rate_per_s: set the rate too (the burst is the "
                "size of its token bucket), or remove admission_burst"
            )
        return self
