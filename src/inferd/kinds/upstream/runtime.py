"""The `openai-upstream` backend: a model served by external OpenAI-compatible engines (vLLM, SGLang, TGI
on real accelerators), so inferd's front end, routing and metrics stand in front of them.

    models/
      big-llm/
        model.toml:   builtin = "openai-upstream"          (or platform = "openai_upstream")
                      [params]
                      upstreams = ["http://gpu-1:8000/v1", "http://gpu-2:8000/v1"]
                      upstream_model = "meta-llama/Llama-3.1-8B-Instruct"   # the name sent upstream
                      api_key_env = "VLLM_API_KEY"          # the key itself stays in the environment

send (acquire the least-loaded healthy upstream -> POST -> one retry elsewhere, under the retry budget, if
it failed before answering) -> UpstreamReply (the caller streams it, then closes it with the outcome).
A caller's deadline bounds every attempt, and travels upstream as X-Request-Timeout-Ms (the time left).
`run` owns the connection pool and probes every upstream with `GET /v1/models` every probe_interval_s.
The policy (health, ejection, choice, the per-upstream cap) is routing.upstreams.UpstreamPool.

The runtime contract's kind "upstream": it has no workers (`accepts_workers` is False); its worker
methods refuse or do nothing, and say so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import aiohttp
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from inferd.clock import Clock
from inferd.config import ConfigError, ModelConfig, describe_validation_error
from inferd.errors import (
    DeadlineExceeded,
    Internal,
    Overloaded,
    ServingError,
    ShuttingDown,
    WorkerUnavailable,
)
from inferd.kinds.upstream.metrics import UpstreamMetrics
from inferd.kinds.upstream.pool import (
    RETRYABLE_STATUSES,
    Outcome,
    UpstreamPool,
    classify_status,
)
from inferd.kinds.upstream.reply import UpstreamReply, UpstreamStatistics, describe
from inferd.observability import tracing
from inferd.routing.health import Health, HealthChange
from inferd.routing.retry import RetryBudget
from inferd.runtime.contract import RuntimeStatistics
from inferd.wire import protocol as p
from inferd.wire.connection import WorkerConnection

log = logging.getLogger("inferd.upstream")

UPSTREAM_PLATFORM = "openai_upstream"
MAX_ATTEMPTS = 2
"""A request that failed before any byte reached the client is tried once more, on another upstream."""
_JSON = {"Content-Type": "application/json"}
TIMEOUT_HEADER = "X-Request-Timeout-Ms"


def is_upstream(config: ModelConfig) -> bool:
    """Whether the model is served by external OpenAI-compatible engines rather than inferd workers."""
    return config.kind == "upstream"


class UpstreamConfig(BaseModel):
    """The `params` of an openai-upstream model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    upstreams: tuple[str, ...] = Field(min_length=1, max_length=256)
    """Base URLs of the engines' OpenAI APIs, e.g. "http://gpu-1:8000/v1"."""
    upstream_model: str | None = None
    """The model name sent upstream; None sends inferd's own model name."""
    api_key_env: str | None = None
    """Name of the environment variable holding the upstreams' API key (sent as a Bearer token)."""
    api_key: SecretStr | None = None
    """Filled from `api_key_env` when the config is loaded; never written in a file."""
    max_inflight_per_upstream: int = Field(default=64, ge=1, le=100_000)
    """Requests in flight per upstream; beyond it on every upstream, new requests get 429 at once."""
    probe_interval_s: float = Field(default=2.0, gt=0.0, le=3600.0)
    """How often every upstream is probed with GET /v1/models."""
    probe_timeout_s: float = Field(default=2.0, gt=0.0, le=600.0)
    """A probe not answered within this counts as a failure."""
    connect_timeout_s: float = Field(default=2.0, gt=0.0, le=600.0)
    """Connecting to an upstream longer than this is a failure (retried elsewhere)."""
    read_timeout_s: float = Field(default=300.0, gt=0.0, le=3600.0)
    """Longest silence between bytes of an upstream's answer before it counts as failed."""
    consecutive_failures: int = Field(default=3, ge=1, le=1000)
    """Failures in a row (requests or probes) that eject an upstream."""
    base_ejection_s: float = Field(default=5.0, gt=0.0, le=3600.0)
    """First ejection's length; each further one doubles it, up to max_ejection_s."""
    max_ejection_s: float = Field(default=60.0, gt=0.0, le=86_400.0)
    """Longest ejection."""
    full_retry_after_s: float = Field(default=1.0, ge=0.0, le=3600.0)
    """Retry-After of the 429 given when every healthy upstream is at its in-flight limit."""

    @field_validator("upstreams")
    @classmethod
    def _urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        clean = tuple(u.rstrip("/") for u in urls)
        for u in clean:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"upstream {u!r} is not an http(s) URL: write e.g. 'http://host:8000/v1'")
        if len(set(clean)) != len(clean):
            raise ValueError(f"upstreams are listed twice in {list(urls)}: list each once")
        return clean

    @model_validator(mode="after")
    def _ejection_order(self) -> UpstreamConfig:
        if self.base_ejection_s > self.max_ejection_s:
            raise ValueError(
                f"base_ejection_s ({self.base_ejection_s}) exceeds max_ejection_s ({self.max_ejection_s}): "
                "lower base_ejection_s or raise max_ejection_s"
            )
        return self


def openai_upstream_config(name: str, environ: Mapping[str, str], **overrides: Any) -> ModelConfig:
    """A model served by upstream engines. The API key is read here, at load, from `params.api_key_env`."""
    params = dict(overrides.pop("params", {}))
    overrides.pop("platform", None)
    if "api_key" in params:
        raise ConfigError(
            f"model {name!r}: params.api_key must not be in a file: put the key in an environment "
            "variable and name that variable in params.api_key_env"
        )
    try:
        upstream = UpstreamConfig(**params)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(f"params of model {name!r}", exc)) from None
    if upstream.api_key_env is not None:
        key = environ.get(upstream.api_key_env)
        if not key:
            raise ConfigError(
                f"model {name!r}: params.api_key_env names {upstream.api_key_env!r}, which is not set in "
                "the environment: export it with the upstreams' API key"
            )
        params["api_key"] = SecretStr(key)
    overrides.setdefault("workers", 0)
    return ModelConfig(
        name=name,
        implementation="inferd.kinds.upstream.runtime:UpstreamRuntime",
        platform=UPSTREAM_PLATFORM,
        kind="upstream",
        params=params,
        **overrides,
    )


class UpstreamRuntime:
    kind: ClassVar[str] = "upstream"
    accepts_workers: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, clock: Clock, metrics: UpstreamMetrics, budget: RetryBudget):
        self.config = config
        self.name = config.name
        self.clock = clock
        self.metrics = metrics
        self.budget = budget
        self.settings = UpstreamConfig.model_validate(config.params)
        s = self.settings
        self.pool = UpstreamPool(
            s.upstreams,
            clock,
            name=f"model '{self.name}'",
            max_inflight=s.max_inflight_per_upstream,
            consecutive_failures=s.consecutive_failures,
            base_ejection_s=s.base_ejection_s,
            max_ejection_s=s.max_ejection_s,
            full_retry_after_s=s.full_retry_after_s,
        )
        self.upstream_model = s.upstream_model or self.name
        self.retries = 0
        self._session: aiohttp.ClientSession | None = None
        self._stopping = False

    # ---- the connection pool and the probes ---------------------------------------------------------
    async def run(self) -> None:
        """Own the HTTP connection pool for the server's lifetime; probe every upstream periodically."""
        s = self.settings
        n = len(s.upstreams)
        connector = aiohttp.TCPConnector(
            limit=n * (s.max_inflight_per_upstream + 1), limit_per_host=s.max_inflight_per_upstream + 1
        )
        timeout = aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_s, sock_read=s.read_timeout_s)
        headers = {"Authorization": f"Bearer {s.api_key.get_secret_value()}"} if s.api_key else {}
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
            self._session = session
            log.info(
                "model %s forwards to upstreams %s as %r", self.name, list(s.upstreams), self.upstream_model
            )
            try:
                while True:
                    await self._probe_all(session)
                    await asyncio.sleep(s.probe_interval_s)
            finally:
                self._session = None

    async def _probe_all(self, session: aiohttp.ClientSession) -> None:
        async with asyncio.TaskGroup() as tg:
            for url in self.settings.upstreams:
                tg.create_task(self._probe(session, url))

    async def _probe(self, session: aiohttp.ClientSession, url: str) -> None:
        detail = ""
        try:
            async with asyncio.timeout(self.settings.probe_timeout_s):
                async with session.get(f"{url}/models") as r:
                    await r.read()
                    ok = r.status == 200
                    detail = "" if ok else f"HTTP {r.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, detail = False, describe(exc)
        self._log(self.pool.probed(url, ok, detail))

    # ---- requests -------------------------------------------------------------------------------------
    async def send(self, path: str, payload: bytes, deadline: float | None = None) -> UpstreamReply:
        """POST `payload` to `path` (e.g. "/completions") of the best upstream; one retry on another if the
        first failed before answering (connection error, or 429/5xx). Raises WorkerUnavailable when no
        upstream answered, Overloaded when every healthy one is full, DeadlineExceeded when `deadline`
        (the runtime's clock) passed before one answered."""
        session = self._session
        if self._stopping or session is None:
            raise ShuttingDown(f"model '{self.name}' is not forwarding (shutting down or starting)")
        self.budget.record_requests()
        failures: list[str] = []
        tried = [self.pool.acquire()]
        while True:
            result = await self._attempt(session, tried[-1], path, payload, deadline)
            if isinstance(result, UpstreamReply) and result.status not in RETRYABLE_STATUSES:
                return result
            following = self._retry_target(tried)
            if following is None:
                if isinstance(result, UpstreamReply):  # the upstream's own error answer passes through
                    return result
                failures.append(result)
                raise WorkerUnavailable(
                    f"model '{self.name}': {'; '.join(failures)}; no upstream left to try"
                )
            if isinstance(result, UpstreamReply):
                failures.append(f"upstream {result.url} answered HTTP {result.status}")
                result.close(classify_status(result.status))
            else:
                failures.append(result)
            tried.append(following)

    async def _attempt(
        self, session: aiohttp.ClientSession, url: str, path: str, payload: bytes, deadline: float | None
    ) -> UpstreamReply | str:
        """The upstream's answer (any status), or what went wrong before it answered. The caller's
        deadline bounds the wait and is passed on as the time left (the upstream's own deadline)."""
        headers = _JSON
        left_s = self.remaining_s(deadline)
        if left_s is not None:
            if left_s <= 0:
                self.release(url, Outcome.IGNORABLE)
                raise self.deadline_error("before an upstream answered")
            headers = {**_JSON, TIMEOUT_HEADER: str(max(1, int(left_s * 1000)))}
        bound = asyncio.timeout(left_s)
        try:
            with tracing.upstream(self.name, url + path, headers) as sent:  # sent: + its traceparent
                async with bound:
                    response = await session.post(url + path, data=payload, headers=sent)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if bound.expired():  # the caller's deadline, not the upstream's failure
                self.release(url, Outcome.IGNORABLE)
                raise self.deadline_error(f"waiting for upstream {url}") from None
            self.release(url, Outcome.FAILURE)
            return f"upstream {url} failed: {describe(exc)}"
        except BaseException:  # cancelled: the client went away (or the server is stopping)
            self.release(url, Outcome.IGNORABLE)
            raise
        return UpstreamReply(self.release, url, response)

    def _retry_target(self, tried: list[str]) -> str | None:
        """Another upstream for one more try, if attempts, healthy upstreams and the retry budget allow."""
        if len(tried) >= MAX_ATTEMPTS or not self.pool.can_take(exclude=tried):
            return None
        if not self.budget.try_spend():
            return None
        try:
            following = self.pool.acquire(exclude=tried)
        except (WorkerUnavailable, Overloaded):
            return None
        self.retries += 1
        return following

    def remaining_s(self, deadline: float | None) -> float | None:
        """Seconds left until `deadline` (the runtime's clock); None without one."""
        return None if deadline is None else deadline - self.clock.now()

    def deadline_error(self, where: str) -> DeadlineExceeded:
        return DeadlineExceeded(f"model '{self.name}': the request's deadline passed {where}")

    def release(self, url: str, outcome: Outcome) -> None:
        self._log(self.pool.release(url, outcome))

    def _log(self, change: HealthChange | None) -> None:
        if change is None:
            return
        if change.health is Health.EJECTED:
            log.warning("model %s: %s", self.name, change)
        else:
            log.info("model %s: %s", self.name, change)

    # ---- the runtime contract: lifecycle, stats, and no workers ----------------------------------------
    @property
    def version(self) -> int:
        return self.config.version

    @property
    def ready(self) -> bool:
        """Forwarding (the connection pool is open, not stopping) with an upstream that may take work."""
        return (
            not self._stopping
            and self._session is not None
            and any(u.health in Health.ROUTABLE for u in self.pool.statistics().upstreams)
        )

    def stop(self, exc: ServingError) -> None:
        """Refuse new requests; nothing is queued here (requests in flight finish or fail on their own)."""
        self._stopping = True

    def statistics(self) -> RuntimeStatistics:
        pool = self.pool.statistics()
        return RuntimeStatistics(
            name=self.name,
            version=self.version,
            kind=self.kind,
            ready=self.ready,
            workers=(),
            ready_workers=0,
            queued=0,
            in_flight=sum(u.inflight for u in pool.upstreams),
            detail=UpstreamStatistics.of(pool, self.retries),
        )

    def add_worker(self, worker: WorkerConnection) -> None:
        raise Internal(
            f"model '{self.name}' is served by upstream engines and takes no workers "
            f"(worker {worker.worker_id} offered)"
        )

    def on_message(self, worker: WorkerConnection, msg: p.Message) -> None:
        """Never called: no worker is ever added."""

    def drain_worker(self, worker: WorkerConnection) -> None:
        """Nothing to drain: no worker is ever added."""

    def on_worker_lost(self, worker: WorkerConnection, reason: str) -> None:
        """Nothing to recover: no worker is ever added."""
