"""Where inferd keeps its files by default: the per-user data folder (search indexes' logs, snapshots and
settings)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def default_data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """$XDG_DATA_HOME/inferd, else ~/.local/share/inferd."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "inferd"
