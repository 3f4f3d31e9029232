"""The model kind "search": how the composition root builds a search index's runtime."""

from __future__ import annotations

from inferd.config import ModelConfig
from inferd.kinds.search.config import SearchParams
from inferd.kinds.search.runtime import SearchRuntime
from inferd.kinds.search.store import IndexStore
from inferd.runtime.contract import Runtime
from inferd.runtime.kinds import Kind, RuntimeContext

ROUTES = "/v1/indexes/{name}/... (PUT, GET, DELETE; POST .../documents and .../search)"
API = "search"
"""The family of routes above (`Kind.api`): an index is a model of a kind that comes in on them."""


def _search_runtime(config: ModelConfig, ctx: RuntimeContext) -> Runtime:
    return SearchRuntime(config, ctx, IndexStore(ctx.server.data_dir))


def search_kind() -> Kind:
    return Kind(
        "search", _search_runtime, params=SearchParams, routes=ROUTES, api=API, rolls_versions=False
    )
