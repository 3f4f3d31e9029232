"""What `inferd bench` offers, to whom and for how long: the load spec the load generator and its HTTP
clients share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from inferd.bench.open_loop import Arrival, arrival_checks
from inferd.bench.spec_checks import header_ok, is_grpc_target, is_plain_http, require

Client = Literal["raw", "aiohttp"]
WireProtocol = Literal["http", "grpc"]

_PATH = "/v2/models/{model}/infer"


@dataclass(frozen=True)
class LoadSpec:
    """What to offer, to whom, and for how long."""

    url: str = "http://127.0.0.1:8000"
    """protocol http: the server's base URL; grpc: its gRPC target, HOST:PORT."""
    model: str = "sim"
    rate: float = 100.0
    """Offered requests per second."""
    duration_s: float = 10.0
    """Length of the measured window."""
    warmup_s: float = 0.0
    """Load offered before the measured window; its results are reported apart."""
    arrival: Arrival = "poisson"
    arrival_cv: float = 3.0
    """gamma arrivals: the coefficient of variation of the gaps."""
    timeout_ms: float = 5000.0
    """Client deadline per request, counted from its intended send time."""
    send_deadline: bool = False
    """Also send the remaining deadline as `X-Request-Timeout-Ms`."""
    priority: str | None = None
    """Sent as `X-Priority` when set."""
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    """More request headers, (name, value), sent with every request (`--header "Name: value"`); kept
    out of the repr and the report by value, as they may hold API keys."""
    payload_bytes: int = 32
    max_requests: int = 1_000_000
    seed: int = 0
    connections: int = 2000
    """Most TCP connections open at once; a request finding none idle and the limit reached waits."""
    grace_s: float = 1.0
    """Extra time after the last deadline before outstanding requests are cancelled."""
    slo_ms: float | None = None
    """When set, also report goodput: ok answers within this latency, per second."""
    client: Client = "raw"
    """HTTP client: 'raw' (lean keep-alive HTTP/1.1 over asyncio, plain http only) or 'aiohttp'."""
    protocol: WireProtocol = "http"
    """'http': OIP v2 JSON over `client`; 'grpc': Triton's ModelInfer with raw_input_contents."""
    channels: int = 4
    """protocol grpc: grpc.aio channels (one HTTP/2 connection each) the requests take in turn."""

    def __post_init__(self) -> None:
        checks = arrival_checks(self) | {
            "timeout_ms must be > 0": self.timeout_ms > 0,
            "connections must be >= 1": self.connections >= 1,
            "payload_bytes must be >= 0": self.payload_bytes >= 0,
            "grace_s must be >= 0": self.grace_s >= 0,
            "client must be 'raw' or 'aiohttp'": self.client in ("raw", "aiohttp"),
            "protocol must be 'http' or 'grpc'": self.protocol in ("http", "grpc"),
            "channels must be >= 1": self.channels >= 1,
            "the raw client needs an http:// url with a host": self.protocol != "http"
            or self.client != "raw"
            or is_plain_http(self.url),
            "protocol grpc needs a HOST:PORT target": self.protocol != "grpc" or is_grpc_target(self.url),
            "a header name must be a token and no header may hold CR or LF": all(
                header_ok(name, value) for name, value in self.headers
            ),
        }
        require(checks, self)

    @property
    def total_s(self) -> float:
        return self.warmup_s + self.duration_s

    @property
    def hard_stop_s(self) -> float:
        """When, from the start, outstanding requests are cancelled: the last deadline plus grace."""
        return self.total_s + self.timeout_ms / 1000.0 + self.grace_s

    @property
    def endpoint(self) -> str:
        return self.url.rstrip("/") + _PATH.format(model=self.model)
