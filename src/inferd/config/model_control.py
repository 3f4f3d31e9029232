"""How the server's set of served models may change while it runs (the repository API, Triton's
`--model-control-mode`): the `[server]` keys ServerConfig inherits."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ModelControlMode = Literal["none", "explicit", "poll"]


class ModelControlSettings(BaseModel):
    """`model_control`, `load_model` and `repository_poll_s` (fleet/model_control.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_control: ModelControlMode = "none"
    """none: every repository model is served at start; explicit: only `load_model`'s; poll: as none,
    and the repository folder is watched (new versions served, removed models unloaded). Load and unload
    (POST /v2/repository/models/{m}/load, /unload) work in every mode."""
    load_model: tuple[str, ...] = ()
    """The models served at start with model_control = "explicit" ("*": all of them)."""
    repository_poll_s: float = Field(default=5.0, gt=0.0, le=3600.0)
    """With model_control = "poll": how often the repository folder is read for changes."""

    @model_validator(mode="after")
    def _load_model_is_explicit(self) -> ModelControlSettings:
        if self.load_model and self.model_control != "explicit":
            raise ValueError(
                f"--load-model (load_model = {list(self.load_model)}) picks the models served at start with "
                f'--model-control explicit only (model_control is "{self.model_control}"): add '
                "--model-control explicit, or drop --load-model (every model is served)"
            )
        return self
