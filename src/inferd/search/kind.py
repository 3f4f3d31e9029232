"""The model kind "search": how the composition root builds a search index's runtime."""

from __future__ import annotations

from inferd.config import ModelConfig
from inferd.runtime.contract import Runtime
from inferd.runtime.kinds import Kind, RuntimeContext
from inferd.search.config import SearchParams
from inferd.search.runtime import SearchRuntime
from inferd.search.store import IndexStore

ROUTES = "/v1/indexes/{name}/... (PUT, GET, DELETE; POST .../documents and .../search)"


def _search_runtime(config: ModelConfig, ctx: RuntimeContext) -> Runtime:
    return SearchRuntime(config, ctx, IndexStore(ctx.server.data_dir))


def search_kind() -> Kind:
    return Kind("search", _search_runtime, params=SearchParams, routes=ROUTES)
