"""What the `inferd serve --frontends 2` integration tests share: a server of two front ends over two `sim`
workers, one /metrics scrape as samples, the owner's ready workers."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.checked_load import wait_for
from tests.conftest import ServerProc, start_server


@contextmanager
def two_frontends(root: Path, config: str) -> Iterator[ServerProc]:
    """`inferd serve --model sim --workers 2 --frontends 2` with `config`, once both workers are ready."""
    path = root / "inferd.toml"
    path.write_text(config)
    proc = start_server(root, "--model", "sim", "--workers", "2", "--frontends", "2", "--config", str(path))
    try:
        wait_for(lambda: len(ready_workers(proc)) == 2, 30, "two ready workers")
        yield proc
    finally:
        proc.stop()


def ready_workers(server: ServerProc) -> list[dict]:
    """The workers the owner's admin API lists as ready."""
    with urllib.request.urlopen(f"{server.admin_url}/admin/workers", timeout=5) as r:
        workers = json.loads(r.read())["workers"]
    return [w for w in workers if w["state"] == "ready"]


def scrape(server: ServerProc) -> dict[str, float]:
    """Sample line -> value, of one /metrics scrape (a new connection: either front end answers)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
