"""`inferd keys new TENANT`: make an API key and the config line that lets it in."""

from __future__ import annotations

from typing import Annotated

import typer

from inferd.gateway.config import TENANT_NAME
from inferd.gateway.keys import key_digest, new_key

keys_app = typer.Typer(no_args_is_help=True, help="API keys of the gateway's tenants.")


@keys_app.command("new")
def new(tenant: Annotated[str, typer.Argument(help="The tenant's name: its [tenants.NAME] table.")]) -> None:
    """Print a fresh API key on the first line, then the config lines to paste: the key's SHA-256 under
    [tenants.TENANT]. The key itself is shown only this once and never stored; give it to the tenant,
    then reload the server (SIGHUP or POST /admin/reload)."""
    if not TENANT_NAME.match(tenant):
        typer.echo(
            f"error: tenant name {tenant[:70]!r} must be 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit",
            err=True,
        )
        raise typer.Exit(2)
    key = new_key()
    typer.echo(key)
    typer.echo(f"[tenants.{tenant}]")
    typer.echo(f'api_key_sha256 = ["{key_digest(key)}"]')
