"""Per-tenant quotas as a plain policy: no I/O, no clock of its own (the caller passes `now`), every
decision returned as a value. The state of one tenant is a small immutable value the caller keeps (in
process, or in Redis through gateway/quota_store.py), so every front end runs this same arithmetic.

Three limits, each optional (a `TenantConfig` field left None is not enforced):

* `requests_per_s` + `burst`: GCRA (a token bucket kept as one "theoretical arrival time"): at most
  `burst` requests at once, then one every 1/requests_per_s seconds.
* `tokens_per_min` (LLM routes): each request reserves prompt + max_tokens at admission; `release`
  refunds what it did not use. The window is a sliding one of 1 s buckets: a request is admitted only
  if the tokens of the last 61 buckets (the current one and the 60 before it) plus its own fit in
  `tokens_per_min`. Every 60 s interval lies within 61 consecutive buckets, so the tokens granted in
  any 60 s interval never exceed `tokens_per_min` (the bound asked of it is that plus one request's
  max_tokens; a fixed, aligned window would allow twice the limit across a window edge). Refunds go
  back to the bucket of their grant, so a finished request frees room at once.
* `max_concurrency`: a lease per admitted request, removed by `release`; a lease that is never
  released (its front end died) expires after `lease_s`, so a crash cannot shrink a tenant for good.

Times are kept as integer microseconds so that "retry after `retry_after_s`" is exact: a refused
request retried that much later, with nothing else changed, is admitted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import msgspec

from inferd.config import ConfigError
from inferd.config.tenants import TenantConfig

_json = msgspec.json.Encoder()

US = 1_000_000
BUCKET_US = US
"""Width of one bucket of the tokens window."""
WINDOW_BUCKETS = 61
"""Buckets a tokens check sums: the current one and the 60 before it (any 60 s interval fits in them)."""


def to_us(seconds: float) -> int:
    return round(seconds * US)


def ceil_ms_s(us: int) -> float:
    """Microseconds rounded up to whole milliseconds, in seconds (what retry_after_s reports)."""
    return math.ceil(us / 1000) / 1000


@dataclass(frozen=True, slots=True)
class QuotaState:
    """One tenant's quota state."""

    tat_us: int = 0
    """GCRA theoretical arrival time of the next request."""
    buckets: tuple[tuple[int, int], ...] = ()
    """(bucket index, tokens net of refunds), oldest first."""
    leases: tuple[tuple[str, int], ...] = ()
    """(lease id, expires at) of the requests in flight."""
    last_us: int = 0
    """The latest time seen: time never goes back for this state, whatever clock the caller has."""

    def encode(self) -> str:
        return _json.encode(
            {"t": self.tat_us, "b": self.buckets, "l": self.leases, "n": self.last_us}
        ).decode()

    @classmethod
    def decode(cls, raw: str | bytes | None) -> QuotaState:
        if not raw:
            return cls()
        data = msgspec.json.decode(raw)
        return cls(
            tat_us=int(data["t"]),
            buckets=tuple((int(i), int(n)) for i, n in data["b"]),
            leases=tuple((str(k), int(e)) for k, e in data["l"]),
            last_us=int(data["n"]),
        )


@dataclass(frozen=True, slots=True)
class Grant:
    """What an admitted request holds until `release`."""

    lease_id: str
    tokens: int = 0
    """Tokens reserved (0 when the route or the tenant has no tokens limit)."""
    bucket: int | None = None
    """The tokens window bucket the reservation went to, for the refund."""
    held: bool = False
    """The state holds a lease for it (a concurrency slot or a refundable reservation): `release` must
    reach the state. False: releasing changes nothing."""


@dataclass(frozen=True, slots=True)
class LimitStatus:
    """One limit as OpenAI's headers describe it."""

    limit: int
    remaining: int
    reset_s: float
    """Time until the limit is back to its full value."""


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    allowed: bool
    at_s: float
    """The time the decision was made at (the policy's clock)."""
    grant: Grant | None = None
    """Set when allowed: hand it back to `release` when the request ends."""
    retry_after_s: float | None = None
    """Refused: the wait after which the same request is admitted if nothing else changes (> 0); None
    when it never can be (it alone asks more than tokens_per_min). Refused by concurrency alone, it is
    when the oldest lease expires: a guarantee, though a release usually comes much sooner."""
    refused_by: tuple[str, ...] = ()
    """Refused: the limits that refused it ("requests", "tokens", "concurrency")."""
    requests: LimitStatus | None = None
    tokens: LimitStatus | None = None

    def headers(self) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers for the limits this tenant has."""
        out: dict[str, str] = {}
        for name, status in (("requests", self.requests), ("tokens", self.tokens)):
            if status is not None:
                out[f"x-ratelimit-limit-{name}"] = str(status.limit)
                out[f"x-ratelimit-remaining-{name}"] = str(status.remaining)
                out[f"x-ratelimit-reset-{name}"] = format_reset(status.reset_s)
        return out


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it (Go's duration format, to the millisecond, rounded
    up): `0s`, `20ms`, `1s`, `1.5s`, `6m0s`, `1h2m3s`."""
    ms = max(0, math.ceil(round(seconds * 1000, 6)))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, frac = divmod(rest, 1000)
    text = f"{secs}" + (f".{frac:03d}".rstrip("0") if frac else "") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text


class QuotaPolicy:
    """The quota arithmetic for one tenant's limits."""

    def __init__(self, limits: TenantConfig, lease_s: float = 600.0) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.limits = limits
        self.lease_us = to_us(lease_s)
        rate = limits.requests_per_s
        self.interval_us = max(1, round(US / rate)) if rate is not None else 0
        self.burst = (limits.burst or max(1, math.ceil(rate))) if rate is not None else 0

    def admit(
        self, state: QuotaState, now_s: float, lease_id: str, tokens: int | None = None
    ) -> tuple[QuotaDecision, QuotaState]:
        """Admit one request (`tokens`: prompt + max_tokens on LLM routes, else None) or refuse it.
        Returns the decision and the state to keep (unchanged but pruned when refused)."""
        now = max(to_us(now_s), state.last_us)
        state = self._prune(state, now)
        at_s = now / US
        tokens = tokens if self.limits.tokens_per_min is not None else None
        waits = {
            "requests": self._requests_wait(state, now),
            "tokens": self._tokens_wait(state, now, tokens),
            "concurrency": self._concurrency_wait(state, now),
        }
        refused = tuple(name for name, wait in waits.items() if wait is None or wait > 0)
        if refused:
            never = any(waits[name] is None for name in refused)
            wait = None if never else max(w for w in waits.values() if w is not None)
            decision = QuotaDecision(
                allowed=False,
                at_s=at_s,
                retry_after_s=None if wait is None else ceil_ms_s(wait + 2),  # 2 us: float rounding
                refused_by=refused,
                requests=self._requests_status(state, now),
                tokens=self._tokens_status(state, now),
            )
            return decision, state
        state, grant = self._take(state, now, lease_id, tokens)
        decision = QuotaDecision(
            allowed=True,
            at_s=at_s,
            grant=grant,
            requests=self._requests_status(state, now),
            tokens=self._tokens_status(state, now),
        )
        return decision, state

    def keep_s(self) -> float:
        """How long a state must be kept after its last update to still matter (leases, the tokens
        window, the requests backlog)."""
        backlog_us = self.burst * self.interval_us
        return max(self.lease_us, WINDOW_BUCKETS * BUCKET_US, backlog_us) / US + 1.0

    def release(self, state: QuotaState, now_s: float, grant: Grant, used_tokens: int | None) -> QuotaState:
        """End an admitted request: free its lease and refund the tokens it reserved but did not use
        (`used_tokens`: prompt + generated; None refunds nothing). Releasing twice, or after the lease
        expired, changes nothing."""
        now = max(to_us(now_s), state.last_us)
        state = self._prune(state, now)
        if all(lease != grant.lease_id for lease, _ in state.leases):
            return state
        leases = tuple(lease for lease in state.leases if lease[0] != grant.lease_id)
        refund = grant.tokens - min(max(used_tokens, 0), grant.tokens) if used_tokens is not None else 0
        buckets = state.buckets
        if refund and grant.bucket is not None:
            buckets = tuple((i, max(0, n - refund) if i == grant.bucket else n) for i, n in buckets)
        return replace(state, leases=leases, buckets=buckets)

    def _prune(self, state: QuotaState, now: int) -> QuotaState:
        oldest = now // BUCKET_US - (WINDOW_BUCKETS - 1)
        return QuotaState(
            tat_us=state.tat_us,
            buckets=tuple((i, n) for i, n in state.buckets if i >= oldest and n > 0),
            leases=tuple((lease, exp) for lease, exp in state.leases if exp > now),
            last_us=now,
        )

    def _take(
        self, state: QuotaState, now: int, lease_id: str, tokens: int | None
    ) -> tuple[QuotaState, Grant]:
        tat = max(state.tat_us, now) + self.interval_us if self.interval_us else state.tat_us
        buckets, bucket = state.buckets, None
        if tokens is not None:
            bucket = now // BUCKET_US
            if buckets and buckets[-1][0] == bucket:
                buckets = (*buckets[:-1], (bucket, buckets[-1][1] + tokens))
            else:
                buckets = (*buckets, (bucket, tokens))
        leases = state.leases
        held = self.limits.max_concurrency is not None or tokens is not None  # (a refund needs the lease)
        if held:
            leases = (*leases, (lease_id, now + self.lease_us))
        grant = Grant(lease_id=lease_id, tokens=tokens or 0, bucket=bucket, held=held)
        return replace(state, tat_us=tat, buckets=buckets, leases=leases), grant

    def _requests_wait(self, state: QuotaState, now: int) -> int:
        if not self.interval_us:
            return 0
        return max(0, max(state.tat_us, now) - now - (self.burst - 1) * self.interval_us)

    def _tokens_wait(self, state: QuotaState, now: int, tokens: int | None) -> int | None:
        limit = self.limits.tokens_per_min
        if limit is None or tokens is None:
            return 0
        if tokens > limit:
            return None
        need = sum(n for _, n in state.buckets) + tokens - limit
        if need <= 0:
            return 0
        for index, n in state.buckets:  # oldest first: when enough of them have left the window
            need -= n
            if need <= 0:
                return (index + WINDOW_BUCKETS) * BUCKET_US - now
        return 0  # not reached: tokens <= limit, so the whole window leaving is always enough

    def _concurrency_wait(self, state: QuotaState, now: int) -> int:
        most = self.limits.max_concurrency
        if most is None or len(state.leases) < most:
            return 0
        expiries = sorted(exp for _, exp in state.leases)
        return expiries[len(state.leases) - most] - now

    def _requests_status(self, state: QuotaState, now: int) -> LimitStatus | None:
        if not self.interval_us:
            return None
        backlog = max(state.tat_us, now) - now
        remaining = max(0, (self.burst * self.interval_us - backlog) // self.interval_us)
        return LimitStatus(limit=self.burst, remaining=remaining, reset_s=backlog / US)

    def _tokens_status(self, state: QuotaState, now: int) -> LimitStatus | None:
        limit = self.limits.tokens_per_min
        if limit is None:
            return None
        used = sum(n for _, n in state.buckets)
        reset = (state.buckets[-1][0] + WINDOW_BUCKETS) * BUCKET_US - now if state.buckets else 0
        return LimitStatus(limit=limit, remaining=max(0, limit - used), reset_s=reset / US)


def check_quota_config(tenants: Mapping[str, TenantConfig], longest_request_tokens: int) -> None:
    """Refuse at start-up a tokens_per_min below the longest request a model accepts (prompt +
    max_tokens up to its context length): such a request could never be admitted."""
    short = [
        f"[tenants.{name}] tokens_per_min = {config.tokens_per_min}"
        for name, config in sorted(tenants.items())
        if config.tokens_per_min is not None and config.tokens_per_min < longest_request_tokens
    ]
    if short:
        raise ConfigError(
            f"{', '.join(short)} is below the longest request a model accepts ({longest_request_tokens} "
            "tokens: prompt + max_tokens up to the context length), so such a request could never be "
            f"admitted: raise tokens_per_min to at least {longest_request_tokens}, or serve that tenant's "
            "models with a shorter context length"
        )
