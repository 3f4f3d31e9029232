"""Model kinds: an open set. Each kind says how to build its runtime and how its params are typed.

The composition root (server.py) registers the built-in kinds (batch, llm, upstream); a component adds
its own (search) with `KindRegistry.register`. A model's `kind` must name a registered kind, and its
params must validate against the kind's params model, or the server refuses to start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from inferd.clock import Clock
from inferd.config import ConfigError, ModelConfig, ServerConfig, describe_validation_error
from inferd.observability.metrics import Metrics
from inferd.routing.retry import RetryBudget
from inferd.runtime.admin_view import AdminView
from inferd.runtime.contract import Runtime, RuntimeStatistics
from inferd.runtime.demand import Autoscaling
from inferd.runtime.membership import WorkerDirectory
from inferd.runtime.waking import Wakers
from inferd.wire.connection import WorkerConnection


@dataclass(frozen=True, slots=True)
class RuntimeContext:
    """What the composition root hands every runtime it builds."""

    server: ServerConfig
    clock: Clock
    metrics: Metrics
    retry_budget: RetryBudget
    """Shared by the models whose workers are ours: failovers cannot multiply load."""
    kill_worker: Callable[[WorkerConnection], None]
    """Kill a hung or silent worker (a local child by SIGKILL, a Ray actor with ray.kill)."""
    directory: WorkerDirectory
    """The server's one worker membership: a runtime with workers takes its version's `Membership` here
    (`directory.members(name, version)`); one that refuses workers takes none."""
    find_model: Callable[..., Runtime] | None = None
    """The registry's `get(name, version=None)`: a served version of a model, by default its default
    version (a search index finds its embedder with it)."""
    follower: bool = False
    """One of several front ends (`--frontends N`) and not the owner: it writes no search log (it
    forwards writes to the owner)."""
    api_of: Callable[[Runtime], str] | None = None
    """The family of routes a runtime's kind is served on (`KindRegistry.api_of`): what a runtime asks of
    another model instead of comparing its kind's name (a search index's embedder serves "oip")."""
    shared_store: Callable[[], tuple[Any, str]] | None = None
    """The store the front ends share (cluster/store.py's Store; typed loosely: runtime/ sits below
    cluster/) and this front end's id in it, once the composition root built them (a callable: the
    cluster is built after this context). A search index's writer lease lives there
    (kinds/search/writers.py). None: a front end alone, each index on a store of its own."""
    wakers: Wakers | None = None
    """Who wakes each model served on demand (runtime/waking.py): a batch or LLM runtime with no worker
    in service asks its model's waker, if one is registered, instead of refusing (kinds/batch/cold.py,
    kinds/llm/cold.py)."""


RuntimeFactory = Callable[[ModelConfig, RuntimeContext], Runtime]
MetricFamilies = Callable[[list[RuntimeStatistics]], list[Any]]
"""A kind's Prometheus families, built at scrape time from the snapshots of its runtimes (every call gets
the kind's snapshots, none of them when it serves no model: its families are exported empty)."""
OTHER_MODELS = AdminView()
"""The admin view of a kind that has none of its own: rows under "other_models", with its detail."""


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    make_runtime: RuntimeFactory
    params: type[BaseModel] | None = None
    """Typed params, checked at start (None: the model class reads free-form params)."""
    has_workers: bool = True
    """Whether the supervisor starts workers for its models (upstream models have none)."""
    routes: str = ""
    """Where its requests go, for errors that send callers to the right API."""
    api: str = ""
    """The family of routes its requests come in on ("oip": OIP infer and embeddings; "text": the OpenAI
    text routes; "search"): a route takes models of its family, a fallback is of the same family."""
    queues_per_frontend: bool = False
    """Its requests queue in each front end (batch): with several front ends a follower reports its
    load (cluster/load.py), and the autoscaler of the front end that decides counts every one's."""
    rolls_versions: bool = True
    """Its models' versions run on workers of ours, rolled by fleet updates, and every front end serves
    the served versions (cluster/served.py). False without workers, and for search (every front
    end follows the owner's indexes through kinds/search/shared_indexes.py)."""
    streams_tokens: bool = False
    """Its models stream tokens: an [slo] table may set ttft_ms and itl_ms (checked by `check`)."""
    admin: AdminView = OTHER_MODELS
    """Its rows in the admin API: which /admin/models section, the keys its model and worker rows add."""
    context_length: Callable[[Runtime], int] | None = None
    """A token model's longest sequence, of one of its runtimes (None: not a token model); the quotas
    bound a request's tokens with it."""
    autoscaling: Autoscaling | None = None
    """How its models scale (runtime/demand.py: its observer and its demand, for fleet/scaling.py); None:
    they do not, and an [autoscale] table on one is refused (upstream models have no workers of ours)."""
    metric_families: MetricFamilies | None = None
    """Its own families on /metrics (kinds/collectors.py `RuntimeCollector` asks each kind, in the order
    the kinds were registered); None: it adds none."""
    counts_workers: bool = False
    """Its workers' states are counted in `inferd_workers` (batch and llm; search's shard replicas are
    workers too, and are not counted there)."""


class KindRegistry:
    def __init__(self, kinds: Iterable[Kind] = ()) -> None:
        self._kinds: dict[str, Kind] = {}
        for kind in kinds:
            self.register(kind)

    def register(self, kind: Kind) -> None:
        if kind.name in self._kinds:
            raise ValueError(f"model kind {kind.name!r} is registered twice")
        self._kinds[kind.name] = kind

    def get(self, name: str) -> Kind:
        kind = self._kinds.get(name)
        if kind is None:
            raise ConfigError(f'unknown model kind "{name}": use one of {sorted(self._kinds)}')
        return kind

    def check(self, config: ModelConfig) -> Kind:
        """The model's kind, with its params validated: a start-up error names the model and the fix."""
        try:
            kind = self.get(config.kind)
        except ConfigError as exc:
            raise ConfigError(f"model {config.name!r}: {exc}") from None
        self.check_slo(config)
        if kind.params is not None:
            try:
                kind.params.model_validate(config.params)
            except ValidationError as exc:
                raise ConfigError(
                    describe_validation_error(f"params of {kind.name} model {config.name!r}", exc)
                ) from None
        return kind

    def check_slo(self, config: ModelConfig) -> None:
        """ttft_ms and itl_ms only on a kind that streams tokens (`Kind.streams_tokens`)."""
        if config.slo is None:
            return
        streaming = frozenset(name for name, k in self._kinds.items() if k.streams_tokens)
        try:
            config.slo.check_kind(config.kind, streaming)
        except ValueError as exc:
            raise ConfigError(f"model {config.name!r}: {exc}") from None

    def __iter__(self) -> Iterator[Kind]:
        """The kinds, in the order they were registered."""
        return iter(list(self._kinds.values()))

    def names(self) -> list[str]:
        return sorted(self._kinds)

    def context_lengths(self, runtimes: Iterable[Runtime]) -> dict[str, int]:
        """Each token model's longest sequence (`Kind.context_length`), by model name."""
        lengths = {rt.name: (rt, self.get(rt.kind).context_length) for rt in runtimes}
        return {name: length(rt) for name, (rt, length) in lengths.items() if length is not None}

    def api_of(self, rt: Runtime) -> str:
        """The family of routes `rt`'s kind is served on (`Kind.api`)."""
        return self.get(rt.kind).api

    def serving(self, api: str) -> frozenset[str]:
        """The kinds whose requests come in on the `api` family of routes."""
        return frozenset(name for name, kind in self._kinds.items() if kind.api == api)

    def same_api(self, kind: str) -> frozenset[str]:
        """The kinds that can answer a `kind` model's requests (an unknown kind: itself alone)."""
        own = self._kinds.get(kind)
        return self.serving(own.api) if own is not None and own.api else frozenset({kind})
