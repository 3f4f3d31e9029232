"""Which of a model's versions are served (a model's `version_policy`), as in Triton."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LatestVersions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    latest: int = Field(ge=1, le=64)
    """Serve the N highest versions."""


class SpecificVersions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    specific: tuple[int, ...] = Field(min_length=1)
    """Serve exactly these versions."""


VersionPolicy = Literal["latest", "all"] | LatestVersions | SpecificVersions
"""Which of a model's versions are served: "latest" (the highest), "all", {latest = N} or
{specific = [1, 3]}."""
