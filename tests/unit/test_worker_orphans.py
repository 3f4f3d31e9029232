"""A local worker whose server is gone (worker/orphans.py): the decision from its parent pid and the
pids its server passed, and what the server passes (only where the parent is the workers' subreaper)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from inferd.config import ServerConfig
from inferd.frontends.plan import FrontendPlan
from inferd.models.sim import sim_config
from inferd.server import InferenceServer
from inferd.worker.orphans import SERVER_PIDS_ENV, orphaned, server_gone, server_pids_env
from inferd.worker.supervisor import Supervisor

OWNER, PARENT = 4100, 4000


@pytest.mark.parametrize(
    ("parent", "gone"),
    [
        (OWNER, False),  # started by the owner, which runs
        (PARENT, False),  # the owner died: reparented to the server's parent, its subreaper
        (1, True),  # the parent was killed, then the owner: reparented to init
        (4321, True),  # or to some other subreaper
    ],
)
def test_a_worker_whose_parent_is_not_the_servers_lost_it(parent: int, gone: bool) -> None:
    value = server_pids_env(OWNER, PARENT)[SERVER_PIDS_ENV]
    assert server_gone(parent, value) is gone


@pytest.mark.parametrize("value", ["", " ", ",", "x,y"])
def test_a_worker_with_no_server_pids_never_lost_its_server(value: str) -> None:
    """Started by hand (`inferd worker --connect ... --reconnect`): it retries forever."""
    assert server_gone(1, value) is False


def test_orphaned_reads_the_environment_and_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    mine = os.getppid()
    assert orphaned("m-0.0", {}) is False
    assert orphaned("m-0.0", server_pids_env(mine, PARENT)) is False
    assert caplog.records == []
    with caplog.at_level(logging.ERROR, "inferd.worker"):
        assert orphaned("m-0.0", server_pids_env(mine + 1, mine + 2)) is True
    assert "worker m-0.0: the server that started it is gone" in caplog.text


def test_the_parents_pid_goes_with_every_front_ends_plan() -> None:
    """0 where the parent could not become the workers' subreaper: they exit with the owner."""
    assert FrontendPlan(0, 2, "/tmp/x", "t").at(1).parent_pid == 0
    assert FrontendPlan(0, 2, "/tmp/x", "t", PARENT).at(1).parent_pid == PARENT


@pytest.mark.parametrize("parent_pid", [0, PARENT])
def test_the_owners_workers_outlive_it_only_under_a_subreaper(tmp_path: Path, parent_pid: int) -> None:
    """No subreaper (no prctl, no /proc): no `--reconnect` and no adoption, or an owner that comes back
    would start its workers a second time beside the first."""
    plan = FrontendPlan(0, 2, str(tmp_path), "t", parent_pid)
    server = InferenceServer(ServerConfig(admin_port=None, workers=1), [sim_config()], frontend=plan)
    supervisor = server.supervisor
    assert isinstance(supervisor, Supervisor)
    assert ("--reconnect" in supervisor.extra_args) is bool(parent_pid)
    assert supervisor.adopt is bool(parent_pid)
    expected = server_pids_env(os.getpid(), parent_pid) if parent_pid else {}
    assert supervisor.bootstrap().env == expected
