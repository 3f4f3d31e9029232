"""A local worker whose server is gone (`inferd serve --frontends N`).

With several front ends the local workers rejoin a lost front end forever (`--reconnect`), so that they
outlive an owner that dies. Their parent is then either the owner that started them or, once it has
died, the server's parent process (their subreaper, runner/parent.py). The server passes both pids in
SERVER_PIDS_ENV; a worker whose parent is neither was orphaned past the server (the parent was killed,
then the owner): no front end will come back for it, so it exits instead of holding its device forever.
A worker started by hand (no SERVER_PIDS_ENV) retries forever.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("inferd.worker")

SERVER_PIDS_ENV = "INFERD_SERVER_PIDS"
"""The pids a local worker's parent may be while its server runs: the owner's and the server parent's."""


def server_pids_env(owner_pid: int, parent_pid: int) -> dict[str, str]:
    """The variable the server adds to its local workers' environment."""
    return {SERVER_PIDS_ENV: f"{owner_pid},{parent_pid}"}


def server_gone(parent: int, server_pids: str) -> bool:
    """Whether a worker whose parent is `parent` lost its server (`server_pids`: SERVER_PIDS_ENV's
    value; empty or without a pid: not a local worker of a server, never gone)."""
    pids = {int(pid) for pid in server_pids.split(",") if pid.strip().isdigit()}
    return bool(pids) and parent not in pids


def orphaned(worker_id: str, environ: Mapping[str, str] = os.environ) -> bool:
    """This worker's server is gone (logged): it must exit rather than rejoin."""
    server_pids = environ.get(SERVER_PIDS_ENV, "")
    parent = os.getppid()
    if not server_gone(parent, server_pids):
        return False
    log.error(
        "worker %s: the server that started it is gone (parent pid %d, not one of %s); exiting",
        worker_id,
        parent,
        server_pids,
    )
    return True
