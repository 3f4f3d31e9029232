"""Typed settings for every component. Loaded once, from TOML plus CLI overrides, then frozen."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)

from inferd.config.autoscaler import AutoscalerConfig
from inferd.config.cache import CacheConfig
from inferd.config.identity import IdentitySettings
from inferd.config.pools import PoolName, Pools
from inferd.config.ports import GrpcSettings, default_admin_port, default_grpc_port
from inferd.config.ports import admin_port_for as admin_port_for  # re-exported for the tools
from inferd.config.ports import grpc_port_for as grpc_port_for  # re-exported for the tools
from inferd.config.tensor_spec import Datatype as Datatype  # re-exported: models and tools import it here
from inferd.config.tensor_spec import TensorSpec as TensorSpec
from inferd.config.traffic import TrafficConfig
from inferd.listener_config import ListenerSettings
from inferd.observability.settings import ObservabilitySettings
from inferd.observability.slo_config import SloConfig, check_slo_batching
from inferd.paths import default_data_dir
from inferd.version_policy import VersionPolicy


class ConfigError(Exception):
    """A configuration problem, with a message that says how to fix it."""


TABLES: dict[str, type[BaseModel]] = {}
"""Top-level tables of the config file that components registered, beside [server] and [models.NAME]."""
MAX_WORKERS = 64
"""The most local workers of one model version (config, scale, a restart's saved slots)."""


def register_table(name: str, model: type[BaseModel]) -> None:
    """A component's own table in the config file (e.g. [gateway]), validated by its own frozen model.
    The component reads it back with `ServerConfig.table(name)`."""
    if name in ("server", "models") or (name in TABLES and TABLES[name] is not model):
        raise ValueError(f"config table [{name}] is already taken")
    TABLES[name] = model


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


_PLATFORM_KINDS = {"inferd_llm": "llm", "openai_upstream": "upstream"}
BATCH_ONLY = frozenset(
    {
        "inputs",
        "outputs",
        "max_batch_size",
        "max_wait_ms",
        "preferred_batch_sizes",
        "max_queue_size", "cold_queue_size",
        "mixed_batch_cost_ratio",
        "batch_timeout_s",
        "max_items_per_request",
        "batching",
        "pool",
        "memory_mb",
    }
)
"""Settings only the batch kind reads."""


class ModelConfig(_Frozen):
    """Per-model serving settings (the knobs Triton users expect). One ModelConfig is one served version."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
    """Model name used in URLs."""
    version: int = Field(default=1, ge=1)
    """Version number (the version folder's name in a model repository)."""
    kind: str = Field(default="batch", pattern=r"^[a-z][a-z0-9_\-]{0,31}$")
    """What serves it: "batch" (dynamic batching over workers), "llm" (token generation, continuous
    batching), "upstream" (external OpenAI-compatible engines), or a kind a component registered."""
    version_policy: VersionPolicy = "latest"
    """Which versions are served side by side (each with its own runtime and workers)."""
    default_version: int | None = Field(default=None, ge=1)
    """The version unversioned requests go to; None: the highest served version."""
    implementation: str
    """Where the model class lives: 'package.module:Class', or 'model.py:Class' inside the version folder."""
    platform: str = "python"
    """Free-form platform string reported in OIP model metadata."""
    max_batch_size: int = Field(default=100, ge=1, le=4096)
    """The most items one batch may hold."""
    batching: Literal["fixed", "slo"] = "fixed"
    """"fixed": cut at max_batch_size or max_wait_ms. "slo": size and wait chosen online from the [slo]
    latency_ms, the measured cost line and the arrival rate; max_batch_size is then the device's hard
    limit and max_wait_ms is ignored once the cost line is measured (kinds/batch/slo_policy.py)."""
    max_wait_ms: float = Field(default=10.0, ge=0.0, le=10_000.0)
    """How long the oldest queued item may wait for company while a worker is free."""
    preferred_batch_sizes: tuple[int, ...] = ()
    """Batch sizes cut at once, without waiting, when a worker is free and enough items are queued."""
    max_queue_size: int = Field(default=2000, ge=1, le=1_000_000)
    """Queued items (not requests) beyond which new requests get 429."""
    cold_queue_size: int | None = Field(default=None, ge=1, le=1_000_000)
    """Items held while no worker is in service and one is woken (kinds/batch/cold.py); None: min(max_queue_size, 4 x max_batch_size)."""
    default_timeout_ms: float | None = Field(default=30_000.0, gt=0.0, le=3_600_000.0)
    """Deadline of a request that sets none; None means no deadline."""
    max_timeout_ms: float = Field(default=600_000.0, gt=0.0, le=3_600_000.0)
    """Largest per-request timeout accepted; larger ones are refused with 400."""
    mixed_batch_cost_ratio: float = Field(default=0.95, gt=0.0, le=1.0)
    """While interactive traffic is active and bulk work is queued, a batch costs at most this share of a
    full batch (measured cost line), and its size is chosen within [half, all] of that cap to stagger the
    workers' finishes (kinds/batch/mix.py): interactive requests wait less for a free worker."""
    idempotent: bool = True
    """Whether a batch may be run again after a worker failure. False: never retried."""
    workers: int | None = Field(default=None, ge=0, le=MAX_WORKERS)
    """Worker processes (devices) for this model; None takes the server's --workers."""
    max_attempts: int = Field(default=3, ge=1, le=10)
    """Most runs of one item after worker crashes (isolation runs of a failing batch not counted)."""
    batch_timeout_s: float | None = Field(default=None, gt=0.0, le=3600.0)
    """A batch running longer than this is a hang: the worker is killed and the batch handled as a crash.
    None: 10 x the observed batch latency, at least 1 s (30 s until a batch has been measured)."""
    progress_timeout_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    """With work queued or running and no batch completed for this long, the model is not ready."""
    autoscale: AutoscalerConfig | None = None
    """Scale this model's local workers from batching-aware signals (None: a fixed `workers`)."""
    cache: CacheConfig = CacheConfig()
    """Exact-match response cache, e.g. `cache = { enabled = true, ttl_s = 60 }` (off by default)."""
    traffic: TrafficConfig = TrafficConfig()
    """Canary, A/B, shadow and fallback between versions and models (config/traffic.py)."""
    slo: SloConfig | None = None
    """Service level objectives, e.g. `slo = { availability = 0.999, latency_ms = 200 }`
    (observability/slo_config.py); None: no SLO events, burn rates or alerting rules for this model."""
    max_items_per_request: int = Field(default=1024, ge=1, le=1_000_000)
    """Largest batch dimension one request may carry."""
    inputs: tuple[TensorSpec, ...] = ()
    """Input tensors, per item (batch models; LLM and upstream models have none)."""
    outputs: tuple[TensorSpec, ...] = ()
    """Output tensors, per item (batch models)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Model-specific settings, handed to the model class."""
    pool: PoolName | None = None
    """The `[pools.NAME]` whose workers load it on demand (no workers of its own); None: its own workers."""
    memory_mb: float | None = Field(default=None, gt=0.0)
    """What one loaded copy takes (MiB), until a load measured it; a pooled model must set it."""

    @model_validator(mode="before")
    @classmethod
    def _kind_from_platform(cls, data: Any) -> Any:
        """`platform = "openai_upstream"` (or "inferd_llm") stays accepted as an alias of the kind."""
        if isinstance(data, dict) and "kind" not in data and data.get("platform") in _PLATFORM_KINDS:
            return {**data, "kind": _PLATFORM_KINDS[data["platform"]]}
        return data

    @model_validator(mode="after")
    def _pool_checks(self) -> ModelConfig:
        """A pooled model is a batch model loaded on its pool's workers: none of its own, a size to place."""
        if self.pool is None:
            return self
        if self.kind != "batch":
            raise ValueError(
                f"pool = {self.pool!r}: only batch models are loaded on a pool's workers; a {self.kind} "
                "model runs on workers of its own: remove `pool`"
            )
        own = [key for key in ("workers", "autoscale") if getattr(self, key) is not None]
        if own:
            raise ValueError(
                f"pool = {self.pool!r} with {own}: a pooled model has no workers of its own (its pool's "
                f"workers load it on demand): remove {' and '.join(own)}, or remove `pool`"
            )
        if self.memory_mb is None:
            raise ValueError(
                f"pool = {self.pool!r} needs memory_mb: what one loaded copy takes, in MiB (the estimate "
                "placement uses until a load measured it), e.g. memory_mb = 500"
            )
        return self

    @model_validator(mode="after")
    def _kind_checks(self) -> ModelConfig:
        """Tensors and batching knobs belong to batch models: another kind that sets them is refused,
        so nobody tunes a setting that nothing reads."""
        if self.kind == "batch":
            if not self.inputs or not self.outputs:
                raise ValueError("a batch model declares its tensors: add [[inputs]] and [[outputs]]")
            return self
        given = sorted(f for f in BATCH_ONLY if self._is_set(f))
        if given:
            raise ValueError(
                f"{given} are batch-model settings; a {self.kind} model does not read them: remove them "
                "(LLM models size their steps with params.scheduler, e.g. max_num_seqs)"
            )
        return self

    def unread_fields(self) -> frozenset[str]:
        """The settings its kind does not read (all at their defaults: `_kind_checks` refuses the others):
        none for a batch model, the batch-only ones for every other kind."""
        return frozenset() if self.kind == "batch" else BATCH_ONLY

    def _is_set(self, field: str) -> bool:
        return getattr(self, field) != type(self).model_fields[field].get_default(call_default_factory=True)

    @model_validator(mode="after")
    def _slo_kind(self) -> ModelConfig:
        check_slo_batching(self.batching, self.slo)
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> ModelConfig:
        for size in self.preferred_batch_sizes:
            if not 1 <= size <= self.max_batch_size:
                raise ValueError(
                    f"preferred batch size {size} is outside 1..max_batch_size ({self.max_batch_size}): "
                    "lower it or raise max_batch_size"
                )
        if self.max_queue_size < self.max_batch_size:
            raise ValueError(
                f"max_queue_size ({self.max_queue_size}) is smaller than max_batch_size "
                f"({self.max_batch_size}): a full batch could never form; raise max_queue_size"
            )
        if self.default_timeout_ms is not None and self.default_timeout_ms > self.max_timeout_ms:
            raise ValueError(
                f"default_timeout_ms ({self.default_timeout_ms}) exceeds max_timeout_ms ({self.max_timeout_ms})"
            )
        for group in (self.inputs, self.outputs):
            names = [t.name for t in group]
            if len(set(names)) != len(names):
                raise ValueError(f"tensor names must be unique, got {names}")
        return self

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_ms / 1000.0


class ServerConfig(ListenerSettings, IdentitySettings, GrpcSettings, _Frozen):
    """Settings of `inferd serve` (listeners' limits and TLS: ListenerSettings; zone, id: IdentitySettings;
    the gRPC listener: GrpcSettings)."""

    host: str = "127.0.0.1"
    """Address the HTTP API listens on."""
    port: int = Field(default=8000, ge=0, le=65535)
    """Port of the HTTP API (0 picks a free one)."""
    workers: int = Field(default=1, ge=0, le=MAX_WORKERS)
    """Default local worker processes per model (0: only workers that join over TCP serve it)."""
    worker_host: str = "127.0.0.1"
    """Address where workers on other hosts connect (`inferd worker --connect HOST:PORT`)."""
    worker_port: int | None = Field(default=None, ge=0, le=65535)
    """TCP port for workers on other hosts; None: local workers only. Needs INFERD_JOIN_TOKEN (except
    with ray_address: the Ray actors present a token of the server's own)."""
    join_token: SecretStr | None = None
    """Token remote workers must present; from the environment (INFERD_JOIN_TOKEN), never from files."""
    model_repo: Path | None = None
    """Model repository folder; None serves the embedded default models."""
    models: tuple[str, ...] = ()
    """Serve only these models (empty: all)."""
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=1024**3)
    """Largest request body; a larger one gets 413 with Connection: close, after the rest of it is read
    and dropped (up to max(64 MiB, 4 x this) and 1 s; one announced larger is refused unread)."""
    access_log: bool = False
    """Log one line per request with its lifecycle record (costly at high rates)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the server and its workers."""
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    """Log format, access-log sampling and trace export, of the server and its workers."""
    worker_start_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    """How long a worker may take to load and warm up before it counts as failed."""
    retry_budget_ratio: float = Field(default=0.2, ge=0.0, le=1.0)
    """Retries may add at most this share of recent requests (on top of the floor below)."""
    retry_budget_min_per_s: float = Field(default=10.0, ge=0.0, le=100_000.0)
    """Retries per second always allowed, whatever the request rate."""
    shadow_max_in_flight: int = Field(default=64, ge=0, le=100_000)
    """Shadow copies (a model's `traffic.shadow`) running at once; a copy over it is dropped."""
    frontends: int = Field(default=1, ge=1, le=64)
    """Front-end processes sharing the HTTP port (SO_REUSEPORT) and the workers; the first one owns the
    local workers, the admin API and the autoscaler (docs/architecture.md, "More than one front end")."""
    heartbeat_timeout_s: float = Field(default=5.0, gt=0.0, le=600.0)
    """A worker silent for this long (no heartbeat, no result) is killed and replaced."""
    admin_token: SecretStr | None = None
    """Bearer token of the admin API; taken from the environment (INFERD_ADMIN_TOKEN), never from files."""
    admin_host: str = "127.0.0.1"
    """Address of the admin API (worker list, drain, restart)."""
    admin_port: int | None = Field(default_factory=default_admin_port, ge=0, le=65535, validate_default=True)
    """Port of the admin API; None disables it. Unless set, the HTTP port + 2 (config/ports.py); 0 (the
    default with port 0): a free one, logged. Protected by INFERD_ADMIN_TOKEN when that is set."""
    grpc_port: int | None = Field(default_factory=default_grpc_port, ge=0, le=65535, validate_default=True)
    """Port of the gRPC API on `host`; None: none (`--no-grpc`). Unless set, the HTTP port + 1; 0: free."""
    shutdown_grace_s: float = Field(default=5.0, ge=0.0, le=600.0)
    """After SIGTERM, how long /v2/health/ready answers 503 while the HTTP listener still accepts and
    serves requests, so probes and load balancers stop sending work before the drain closes the
    listener; 0: drain at once. A second SIGTERM (or Ctrl-C) ends the grace period early."""
    cache_dir: Path | None = None
    """Where one-time model conversions are cached (default ~/.cache/inferd)."""
    data_dir: Path = Field(default_factory=lambda: default_data_dir())
    """Where search indexes keep their logs, snapshots and settings (default: paths.default_data_dir); an
    index created through the API is served again from here after a restart."""
    model_overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per-model setting overrides, from [models.NAME] tables of the config file."""
    ray_address: str | None = None
    """Run the workers as Ray actors on this Ray cluster (an address as ray.init takes it: HOST:PORT,
    "auto" for the cluster this host belongs to, "local" for a new one-node cluster) instead of local
    processes; needs the inferd[ray] extra. The actors join over the worker port (a free one when
    worker_port is unset) with a token of the server's own; set worker_host to an address the
    cluster's nodes reach (0.0.0.0: this host's Ray node address) when the cluster spans hosts."""
    tables: dict[str, Any] = Field(default_factory=dict)
    """Components' own tables from the config file, each validated by the model it registered."""
    ray_resource: str | None = None
    """The Ray resource each worker actor holds one of: None takes GPU when the cluster has GPUs, else the
    custom resource inferd_device (start CPU-only nodes with --resources='{"inferd_device": N}')."""
    pools: Pools = Field(default_factory=dict)
    """The `[pools.NAME]` tables (config/pools.py): workers that load pooled models on demand."""
    config_path: Path | None = None
    """The --config file these settings came from (None: none); re-read when the gateway reloads its
    tenants and keys (SIGHUP, POST /admin/reload)."""

    def table(self, name: str) -> Any:
        """A registered component table: the file's, else the component model's defaults."""
        if name not in TABLES:
            raise KeyError(f"no component registered the config table [{name}]")
        return self.tables.get(name) or TABLES[name]()


def load_server_config(
    path: Path | None, overrides: dict[str, Any], environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """Read the TOML file (if any), apply CLI overrides (None values are ignored), take secrets from the
    environment, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(
                f"config file {path} does not exist: pass an existing file to --config"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path} cannot be read as UTF-8 text: {exc}") from None
        for table in ("server", "models", "pools"):
            if not isinstance(raw.get(table, {}), dict):
                raise ConfigError(
                    f"config file {path}: {table} must be a table ([{table}]), got {raw[table]!r}"
                )
        unknown = set(raw) - {"server", "models", "pools"} - set(TABLES)
        if unknown:
            raise ConfigError(
                f"config file {path} has unknown tables {sorted(unknown)}: use [server], [models.NAME], [pools.NAME]"
                + "".join(f", [{t}]" for t in sorted(TABLES))
            )
        data.update(raw.get("server", {}))
        data["config_path"] = path
        data["model_overrides"] = raw.get("models", {})
        data["pools"] = raw.get("pools", {})
        data["tables"] = {name: _component_table(name, raw[name]) for name in raw if name in TABLES}
    data.update({k: v for k, v in overrides.items() if v is not None})
    env = os.environ if environ is None else environ
    if "admin_token" in data:
        raise ConfigError(
            "admin_token must not be in a config file: set INFERD_ADMIN_TOKEN in the environment"
        )
    if env.get("INFERD_ADMIN_TOKEN"):
        data["admin_token"] = env["INFERD_ADMIN_TOKEN"]
    if "join_token" in data:
        raise ConfigError("join_token must not be in a config file: set INFERD_JOIN_TOKEN in the environment")
    if env.get("INFERD_JOIN_TOKEN"):
        data["join_token"] = env["INFERD_JOIN_TOKEN"]
    if data.get("worker_port") is not None and not data.get("join_token") and not data.get("ray_address"):
        raise ConfigError(
            "a worker port for remote workers needs a join token: set INFERD_JOIN_TOKEN "
            "(and give the same token to `inferd worker`)"
        )
    try:
        return ServerConfig(**data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error("server config", exc)) from None


def _component_table(name: str, raw: Any) -> BaseModel:
    try:
        return TABLES[name].model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(f"[{name}] table", exc)) from None


def describe_validation_error(what: str, exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err["type"] == "default_factory_not_called":  # a default derived from a field already reported
            continue
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    return f"invalid {what}: " + "; ".join(parts)
