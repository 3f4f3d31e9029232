"""The built-in model kinds: batch (kinds/batch/dispatcher.py), llm (kinds/llm/runtime.py), upstream
(kinds/upstream/runtime.py) and search (kinds/search/kind.py). The composition root (server.py) starts
from these."""

from __future__ import annotations

from typing import cast

from inferd.cluster.config import cluster_config
from inferd.config import ModelConfig
from inferd.kinds.batch.admin_view import BATCH_ADMIN
from inferd.kinds.batch.demand import BATCH_AUTOSCALING
from inferd.kinds.batch.dispatcher import ModelRuntime
from inferd.kinds.batch.metrics import batch_families
from inferd.kinds.llm.admin_view import LLM_ADMIN
from inferd.kinds.llm.demand import LLM_AUTOSCALING
from inferd.kinds.llm.metrics import llm_families
from inferd.kinds.llm.params import LLMParams
from inferd.kinds.llm.runtime import LLMRuntime
from inferd.kinds.search.kind import search_kind
from inferd.kinds.upstream.metrics import UpstreamMetrics, upstream_families
from inferd.kinds.upstream.runtime import UpstreamConfig, UpstreamRuntime
from inferd.routing.locality import LocalityPolicy
from inferd.routing.retry import RetryBudget
from inferd.runtime.contract import Runtime
from inferd.runtime.kinds import Kind, KindRegistry, RuntimeContext


def _locality(ctx: RuntimeContext) -> LocalityPolicy:
    """A model version's zone routing: this front end's zone first (`[server] zone`), spilling by
    `[cluster] overprovisioning` (routing/locality.py); with no zone, it routes as without zones."""
    return LocalityPolicy(ctx.clock, ctx.server.zone, overprovisioning=cluster_config(ctx.server).overprovisioning)


def _batch_runtime(config: ModelConfig, ctx: RuntimeContext) -> Runtime:
    return ModelRuntime(
        config,
        ctx.clock,
        ctx.metrics.for_model(config.name, config.version),
        ctx.retry_budget,
        ctx.kill_worker,
        heartbeat_timeout_s=ctx.server.heartbeat_timeout_s,
        members=ctx.directory.members(config.name, config.version),
        locality=_locality(ctx),
        wakers=ctx.wakers,
    )


def _llm_runtime(config: ModelConfig, ctx: RuntimeContext) -> Runtime:
    return LLMRuntime(
        config,
        ctx.clock,
        ctx.metrics.for_llm(config.name, config.version),
        ctx.retry_budget,
        kill_worker=ctx.kill_worker,
        heartbeat_timeout_s=ctx.server.heartbeat_timeout_s,
        members=ctx.directory.members(config.name, config.version),
        locality=_locality(ctx),
        wakers=ctx.wakers,
    )


def _upstream_runtime(config: ModelConfig, ctx: RuntimeContext) -> Runtime:
    """An upstream-served model, with a retry budget of its own (its failures are its upstreams')."""
    budget = RetryBudget(ctx.clock, ctx.server.retry_budget_ratio, ctx.server.retry_budget_min_per_s)
    return UpstreamRuntime(
        config, ctx.clock, UpstreamMetrics(ctx.metrics, config.name, config.version), budget
    )


def builtin_kinds() -> KindRegistry:
    return KindRegistry(
        [
            Kind(
                "batch",
                _batch_runtime,
                routes="POST /v2/models/{model}/infer (OIP), /v1/embeddings",
                api="oip",
                queues_per_frontend=True,
                admin=BATCH_ADMIN,
                autoscaling=BATCH_AUTOSCALING,
                metric_families=batch_families,
                counts_workers=True,
            ),
            Kind(
                "llm",
                _llm_runtime,
                params=LLMParams,
                routes="POST /v1/chat/completions or /v1/completions (OpenAI)",
                api="text",
                streams_tokens=True,
                admin=LLM_ADMIN,
                context_length=lambda rt: cast(LLMRuntime, rt).max_model_len,
                autoscaling=LLM_AUTOSCALING,
                metric_families=llm_families,
                counts_workers=True,
            ),
            Kind(
                "upstream",
                _upstream_runtime,
                params=UpstreamConfig,
                has_workers=False,
                rolls_versions=False,
                routes="POST /v1/chat/completions or /v1/completions (OpenAI)",
                api="text",
                metric_families=upstream_families,
            ),
            search_kind(),
        ]
    )
