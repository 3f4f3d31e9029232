"""`inferd slo rules` and `inferd slo dashboard`: the Prometheus rules of the configured SLOs and the
Grafana dashboard (docs/slo.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from inferd.config import ConfigError, load_server_config
from inferd.observability.slo_config import SloConfig, model_slos

slo_app = typer.Typer(
    no_args_is_help=True, help="Service level objectives: Prometheus alerting rules and a Grafana dashboard."
)


def configured_slos(config: Path | None, model_repo: Path | None) -> dict[str, SloConfig]:
    """The [slo] tables of the models `inferd serve` would serve with the same --config and
    --model-repo (model.toml files, then [models.NAME] overrides of the config file)."""
    from inferd.kinds.builtin import builtin_kinds
    from inferd.kinds.repository import apply_overrides, default_models, load_repository

    cfg = load_server_config(config, {"model_repo": model_repo}, environ={})
    models = load_repository(cfg.model_repo) if cfg.model_repo else default_models(cfg.cache_dir)
    served = apply_overrides(models, cfg.model_overrides)
    kinds = builtin_kinds()
    for m in served:
        kinds.check(m)  # what `inferd serve` would refuse (an LLM's SLOs on a batch model)
    return model_slos(served)


def _write(text: str, output: Path | None) -> None:
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)


@slo_app.command()
def rules(
    config: Annotated[
        Path | None, typer.Option(help="TOML config file (its [models.NAME.slo] tables override model.toml).")
    ] = None,
    model_repo: Annotated[
        Path | None,
        typer.Option(
            "--model-repo",
            "--model-repository",
            help="Model repository folder (each model.toml may hold an [slo] table). Default: the embedded models.",
        ),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")
    ] = None,
) -> None:
    """Write the Prometheus recording and multiwindow burn-rate alerting rules of every model with an
    [slo] table (check them with `promtool check rules`)."""
    from inferd.observability.slo_rules import rules_yaml

    try:
        slos = configured_slos(config, model_repo)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if not slos:
        typer.echo(
            "error: no served model has an [slo] table: add one to a model.toml, or [models.NAME.slo] "
            "to the --config file (docs/slo.md)",
            err=True,
        )
        raise typer.Exit(2)
    _write(rules_yaml(slos), output)


@slo_app.command()
def dashboard(
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")
    ] = None,
) -> None:
    """Write the Grafana dashboard JSON (the committed copy is deploy/grafana/inferd.json)."""
    from inferd.observability.slo_dashboard import dashboard_json

    _write(dashboard_json(), output)
