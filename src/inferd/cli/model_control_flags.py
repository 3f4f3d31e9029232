"""The model-control flags of `inferd serve` (config/model_control.py's keys of [server])."""

from __future__ import annotations

from typing import Annotated

import typer

ModelControlFlag = Annotated[
    str | None,
    typer.Option(
        "--model-control",
        help="none: serve every repository model at start; explicit: only the --load-model ones; poll: as "
        "none, and watch the repository folder (new versions served, removed models unloaded). Load and "
        "unload (POST /v2/repository/models/M/load, /unload) work in every mode (default: none).",
    ),
]
LoadModelFlag = Annotated[
    list[str] | None,
    typer.Option(
        "--load-model",
        help="With --model-control explicit: serve this model at start (repeatable; * for all).",
    ),
]
