"""Model kinds: an open set. Each kind says how to build its runtime and how its params are typed.

The composition root (server.py) registers the built-in kinds (batch, llm, upstream); a component adds
its own (search) with `KindRegistry.register`. A model's `kind` must name a registered kind, and its
params must validate against the kind's params model, or the server refuses to start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from inferd.clock import Clock
from inferd.config import ConfigError, ModelConfig, ServerConfig, describe_validation_error
from inferd.observability.metrics import Metrics
from inferd.routing.retry import RetryBudget
from inferd.runtime.contract import Runtime
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
    find_model: Callable[..., Runtime] | None = None
    """The registry's `get(name, version=None)`: a served version of a model, by default its default
    version (a search index finds its embedder with it)."""
    follower: bool = False
    """One of several front ends (`--frontends N`) and not the owner: it writes no search log (it
    forwards writes to the owner)."""


RuntimeFactory = Callable[[ModelConfig, RuntimeContext], Runtime]


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
        if kind.params is not None:
            try:
                kind.params.model_validate(config.params)
            except ValidationError as exc:
                raise ConfigError(
                    describe_validation_error(f"params of {kind.name} model {config.name!r}", exc)
                ) from None
        return kind

    def names(self) -> list[str]:
        return sorted(self._kinds)

    def serving(self, api: str) -> frozenset[str]:
        """The kinds whose requests come in on the `api` family of routes."""
        return frozenset(name for name, kind in self._kinds.items() if kind.api == api)

    def same_api(self, kind: str) -> frozenset[str]:
        """The kinds that can answer a `kind` model's requests (an unknown kind: itself alone)."""
        own = self._kinds.get(kind)
        return self.serving(own.api) if own is not None and own.api else frozenset({kind})
