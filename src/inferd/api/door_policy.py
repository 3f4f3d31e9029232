"""The front door's limits, decided without I/O: connection caps (in all and per client address), the
request head's size, the admission rate (a token bucket), and requests per keep-alive connection.

A plain object with an injected clock. Each question returns its answer as a value (None: go on; an
error: refuse with it); `frontdoor.py` does the socket work and turns refusals into canned responses.
`DoorCollector` shows its counts on /metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from inferd.clock import Clock
from inferd.config import ServerConfig
from inferd.errors import HeaderTooLarge, Overloaded, RateLimited, RequestTimeout, ServingError

REPORT_EVERY_S = 10.0
"""Refusals are logged at most this often (with the counts so far)."""
UNMETERED = (b"/v2/health/", b"/metrics")
"""Request targets the admission rate never refuses (liveness and readiness probes, metrics)."""
CONNECTION_RETRY_AFTER_S = 1.0
"""Retry-After of a connection refused at a connection cap: slots free as other clients finish."""


@dataclass(frozen=True, slots=True)
class DoorLimits:
    """The front door's settings, as the policy reads them (see ServerConfig for each one)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 16 * 1024
    max_header_count: int = 100
    max_connections: int = 4096
    max_connections_per_ip: int | None = 2048
    keep_alive_timeout_s: float = 30.0
    max_requests_per_connection: int | None = None
    admission_rate_per_s: float | None = None
    admission_burst: int | None = None

    @classmethod
    def of(cls, cfg: ServerConfig) -> DoorLimits:
        return cls(
            header_timeout_s=cfg.header_timeout_s,
            body_timeout_s=cfg.body_timeout_s,
            max_header_bytes=cfg.max_header_bytes,
            max_header_count=cfg.max_header_count,
            max_connections=cfg.max_connections,
            max_connections_per_ip=cfg.max_connections_per_ip,
            keep_alive_timeout_s=cfg.keep_alive_timeout_s,
            max_requests_per_connection=cfg.max_requests_per_connection,
            admission_rate_per_s=cfg.admission_rate_per_s,
            admission_burst=cfg.admission_burst,
        )


@dataclass(frozen=True, slots=True)
class DoorStatistics:
    open_connections: int
    busiest_address: int
    """Open connections of the client address with the most."""
    refused: dict[str, int]
    """Refusals and closes so far, by reason (connections, connections_per_ip, rate, header_size,
    header_timeout, body_timeout)."""


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved; one token admits one request."""

    def __init__(self, rate: float, burst: float, clock: Clock) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a token bucket needs rate > 0 and burst >= 1, got rate {rate}, burst {burst}")
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = burst
        self.at = clock.now()

    def take(self) -> float | None:
        """None when a token was taken; else the seconds until one will be there."""
        now = self.clock.now()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0 - 1e-9:  # a token refilled to the instant, less float rounding
            self.tokens = max(0.0, self.tokens - 1.0)
            return None
        return (1.0 - self.tokens) / self.rate


class DoorPolicy:
    """Limits of one front-end process. Connections are counted from `connect` (when it returns None)
    to `disconnect`; requests from `admit`."""

    def __init__(self, limits: DoorLimits, clock: Clock) -> None:
        self.limits = limits
        self.clock = clock
        self.per_ip: Counter[str] = Counter()
        self.open = 0
        self.refused: Counter[str] = Counter()
        self.reported_at: float | None = None
        self.bucket: TokenBucket | None = None
        if limits.admission_rate_per_s is not None:
            rate = limits.admission_rate_per_s
            burst = limits.admission_burst if limits.admission_burst is not None else max(1.0, rate)
            self.bucket = TokenBucket(rate, burst, clock)

    def connect(self, ip: str) -> ServingError | None:
        """A new connection from `ip`: None counts it in; an error refuses it (not counted)."""
        lim = self.limits
        if self.open >= lim.max_connections:
            self.refused["connections"] += 1
            return Overloaded(
                f"too many connections: {self.open} open, the limit is {lim.max_connections}",
                CONNECTION_RETRY_AFTER_S,
                reason="connections",
            )
        if lim.max_connections_per_ip is not None and self.per_ip[ip] >= lim.max_connections_per_ip:
            self.refused["connections_per_ip"] += 1
            return Overloaded(
                f"too many connections from {ip}: {self.per_ip[ip]} open, the limit per client address "
                f"is {lim.max_connections_per_ip}",
                CONNECTION_RETRY_AFTER_S,
                reason="connections_per_ip",
            )
        self.open += 1
        self.per_ip[ip] += 1
        return None

    def disconnect(self, ip: str) -> None:
        """A connection that `connect` counted in has closed."""
        self.open -= 1
        left = self.per_ip[ip] - 1
        if left > 0:
            self.per_ip[ip] = left
        else:
            del self.per_ip[ip]

    def check_head(self, size_bytes: int, header_count: int) -> ServingError | None:
        """The request head so far: its bytes and its header lines."""
        lim = self.limits
        if size_bytes > lim.max_header_bytes or header_count > lim.max_header_count:
            self.refused["header_size"] += 1
            return HeaderTooLarge(
                f"request head too large: {size_bytes} bytes and {header_count} header lines so far, "
                f"the limits are {lim.max_header_bytes} bytes and {lim.max_header_count} lines"
            )
        return None

    def admit(self, target: bytes) -> ServingError | None:
        """A complete request head for `target` (the request line's path and query), before the app and
        before its body: the admission rate. Health probes and metrics scrapes pass free, so a flood
        does not make the server look dead to its orchestrator."""
        if self.bucket is None or target.startswith(UNMETERED):
            return None
        wait_s = self.bucket.take()
        if wait_s is None:
            return None
        self.refused["rate"] += 1
        return RateLimited(
            f"over the admission rate of {self.bucket.rate:g} requests/s: retry in {wait_s * 1000:.0f} ms",
            wait_s,
        )

    def keep_alive(self, requests_on_connection: int) -> bool:
        """Whether the connection may carry another request after this many."""
        cap = self.limits.max_requests_per_connection
        return cap is None or requests_on_connection < cap

    def head_timed_out(self) -> RequestTimeout:
        self.refused["header_timeout"] += 1
        return RequestTimeout(
            f"request head not complete within {self.limits.header_timeout_s:g} s (header_timeout_s)"
        )

    def body_timed_out(self) -> RequestTimeout:
        self.refused["body_timeout"] += 1
        return RequestTimeout(
            f"request body not complete within {self.limits.body_timeout_s:g} s (body_timeout_s)"
        )

    def report_due(self) -> bool:
        """Whether to log the refusals now (at most once per REPORT_EVERY_S); True starts a new period."""
        now = self.clock.now()
        if self.reported_at is not None and now - self.reported_at < REPORT_EVERY_S:
            return False
        self.reported_at = now
        return True

    def statistics(self) -> DoorStatistics:
        busiest = max(self.per_ip.values(), default=0)
        return DoorStatistics(self.open, busiest, dict(self.refused))


class DoorCollector(Collector):
    """The front door's open connections and refusals, read from its policy at scrape time."""

    def __init__(self, door: DoorPolicy) -> None:
        self._door = door

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        stats = self._door.statistics()
        open_ = GaugeMetricFamily("inferd_frontdoor_connections", "Open HTTP connections (counted in).")
        open_.add_metric([], stats.open_connections)
        refused = CounterMetricFamily(
            "inferd_frontdoor_refused",
            "Requests and connections refused or cut off by the front door, by reason.",
            labels=["reason"],
        )
        for reason, count in sorted(stats.refused.items()):
            refused.add_metric([reason], count)
        return [open_, refused]
