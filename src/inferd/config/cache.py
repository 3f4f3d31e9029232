"""The per-model `cache` setting: `cache = { enabled = true, ttl_s = 60, max_entries = 10000 }`, and
`store = "redis"` to share the answers between front ends through `[gateway] redis_url`.

Kept apart from the cache itself (it imports only pydantic) so config.py can import it without a cycle.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class CacheConfig(BaseModel):
    """Exact-match response cache of one model version (gateway/cache.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = False
    """Answer repeated identical requests from memory. Turning it on declares that the model's outputs
    are deterministic for equal inputs and parameters (true of sim and the embedders); LLM requests are
    cached only with temperature 0 or a seed, and never when streamed."""
    ttl_s: float = Field(default=60.0, gt=0.0, le=7 * 86_400.0)
    """How long an answer stays servable after it was computed."""
    max_entries: int = Field(default=10_000, ge=1, le=10_000_000)
    """Most answers kept; the least recently used go first."""
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, le=64 * 1024**3)
    """Most bytes of answers kept (their encoded size); an answer larger than this is never kept."""
    store: Literal["memory", "redis"] = "memory"
    """Where the answers live: "memory" (this front end's own) or "redis" (shared by every front end
    on `[gateway] redis_url`, gateway/redis_cache.py; needs the inferd[redis] extra)."""
