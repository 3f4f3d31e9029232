"""What `inferd bench-llm` offers: the spec, length distributions, and the planned requests.

Every request is planned before the run: its intended send time (Poisson or constant arrivals), its
prompt and its `max_tokens`. Prompts are words (no whitespace inside a word), so sim-llm's whitespace
tokenizer sees exactly the asked prompt length. The first word is unique per request, so no two
prompts share a KV block and the prefix cache does not flatter the figures.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from inferd.bench.open_loop import Arrival, arrival_checks, arrival_offsets
from inferd.bench.spec_checks import is_grpc_target, is_plain_http, require

_PROMPT_WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
_LENGTH = re.compile(r"^\s*(\d+)\s*(?:[-:]\s*(\d+)\s*)?$")


@dataclass(frozen=True)
class LengthDist:
    """A token count: fixed (`low == high`) or uniform over the integers low..high inclusive."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"a length range needs 1 <= low <= high, got {self.low}..{self.high}")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """'128' (fixed) or '32-512' / '32:512' (uniform, inclusive)."""
        m = _LENGTH.match(text)
        if m is None:
            raise ValueError(f"length {text!r}: write N (fixed) or LOW-HIGH (uniform), e.g. 32-512")
        low = int(m.group(1))
        return cls(low, int(m.group(2) or low))

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(self.low, self.high + 1, size=n).tolist()

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True)
class LLMLoadSpec:
    """What to offer, to whom, for how long, and the SLO that decides goodput."""

    url: str = "http://127.0.0.1:8000"
    """protocol http: the server's base URL; grpc: its gRPC target, HOST:PORT."""
    model: str = "sim-llm"
    rate: float = 5.0
    """Offered requests per second."""
    duration_s: float = 30.0
    """Length of the measured window (intended send times)."""
    warmup_s: float = 0.0
    """Load offered before the measured window; its results are reported apart."""
    arrival: Arrival = "poisson"
    arrival_cv: float = 3.0
    """gamma arrivals: the coefficient of variation of the gaps."""
    prompt_tokens: LengthDist = LengthDist(128, 128)
    output_tokens: LengthDist = LengthDist(128, 128)
    """Sent as `max_tokens`. sim-llm never stops early, so it generates exactly this many."""
    max_requests: int = 100_000
    seed: int = 0
    timeout_s: float = 120.0
    """Client deadline per request, counted from its intended send time."""
    grace_s: float = 1.0
    """Extra time after the last deadline before outstanding streams are cancelled."""
    connections: int = 1000
    """Most streams open at once; a request finding the limit reached waits (counted in its latency)."""
    ttft_slo_ms: float = 1500.0
    itl_slo_ms: float = 150.0
    check: bool = True
    """Check each stream's text against `sim_llm_tokens` (only meaningful for sim-llm)."""
    priority: str | None = None
    """Sent as `X-Priority` when set."""
    protocol: str = "http"
    """'http': streaming /v1/completions (SSE); 'grpc': ModelStreamInfer with Triton's vLLM tensors."""
    channels: int = 4
    """protocol grpc: grpc.aio channels (one HTTP/2 connection each) the streams take in turn."""
    streams: int = 0
    """protocol grpc: 0, a ModelStreamInfer stream per request; N, every request on one of N long-lived
    streams, answers matched by id (as tritonclient's start_stream + async_stream_infer)."""
    temperature: float = 1.0
    """Sent in gRPC's sampling_parameters (the completions route's default when the body has none)."""

    def __post_init__(self) -> None:
        checks = arrival_checks(self) | {
            "timeout_s must be > 0": self.timeout_s > 0,
            "connections must be >= 1": self.connections >= 1,
            "grace_s must be >= 0": self.grace_s >= 0,
            "ttft_slo_ms and itl_slo_ms must be > 0": self.ttft_slo_ms > 0 and self.itl_slo_ms > 0,
            "protocol must be 'http' or 'grpc'": self.protocol in ("http", "grpc"),
            "channels must be >= 1": self.channels >= 1,
            "streams must be >= 0": self.streams >= 0,
            "url must be http://HOST[:PORT]": self.protocol != "http" or is_plain_http(self.url),
            "protocol grpc needs a HOST:PORT target": self.protocol != "grpc" or is_grpc_target(self.url),
        }
        require(checks, self)

    @property
    def total_s(self) -> float:
        return self.warmup_s + self.duration_s

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["prompt_tokens"] = str(self.prompt_tokens)
        out["output_tokens"] = str(self.output_tokens)
        return out


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    i: int
    offset_s: float
    """Intended send time, seconds from the start of the run."""
    prompt: str
    prompt_tokens: int
    max_tokens: int

    @property
    def seed(self) -> int:
        """The sampling seed sent with the request (sim-llm's tokens depend on it)."""
        return self.i


def prompt_text(seed: int, i: int, n: int, rng: np.random.Generator) -> str:
    """n whitespace-separated words; the first is unique to (seed, i)."""
    picks = rng.integers(0, len(_PROMPT_WORDS), size=n - 1).tolist()
    return " ".join([f"req{seed}x{i}", *(_PROMPT_WORDS[k] for k in picks)])


def plan_requests(spec: LLMLoadSpec) -> list[PlannedRequest]:
    """Every request of the run, in send order: arrival times as `inferd bench`'s, seeded lengths."""
    offsets = arrival_offsets(spec)
    rng = np.random.default_rng([spec.seed, 1])
    prompts = spec.prompt_tokens.sample(rng, len(offsets))
    outputs = spec.output_tokens.sample(rng, len(offsets))
    return [
        PlannedRequest(i, offset, prompt_text(spec.seed, i, p, rng), p, o)
        for i, (offset, p, o) in enumerate(zip(offsets, prompts, outputs, strict=True))
    ]


def completion_body(spec: LLMLoadSpec, req: PlannedRequest) -> bytes:
    """The streaming /v1/completions request, asking for the usage chunk (exact token counts)."""
    body = {
        "model": spec.model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "seed": req.seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body, separators=(",", ":")).encode()
