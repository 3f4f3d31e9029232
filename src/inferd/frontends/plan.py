"""Where the front ends of one server meet: their worker sockets, their metrics sockets, the join token
of the local workers. Computed once by the parent and handed to every front end."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FrontendPlan:
    index: int
    """This front end's place: 0 is the owner (local workers, admin API, autoscaler, updates)."""
    count: int
    socket_dir: str
    """The parent's folder for the front ends' Unix sockets (removed by the parent)."""
    token: str
    """The local workers' join token, accepted by every front end."""
    parent_pid: int = 0
    """The parent process when it is the local workers' subreaper (and /proc is there): the owner's
    workers outlive it and the next owner adopts them. 0: they exit with the owner."""

    @property
    def is_owner(self) -> bool:
        return self.index == 0

    def worker_address(self, index: int) -> str:
        return f"unix:{os.path.join(self.socket_dir, f'workers-{index}.sock')}"

    def worker_addresses(self) -> str:
        """What the local workers connect to: every front end, the owner first (a comma list)."""
        return ",".join(self.worker_address(i) for i in range(self.count))

    def metrics_path(self, index: int) -> str:
        return os.path.join(self.socket_dir, f"metrics-{index}.sock")

    def channel_path(self, index: int) -> str:
        """Where front end `index` takes the other front ends' requests (frontends/channel.py): the
        search writes they forward to it."""
        return os.path.join(self.socket_dir, f"frontend-{index}.sock")

    def channel_address(self, index: int) -> str:
        return f"unix:{self.channel_path(index)}"

    def store_path(self) -> str:
        """Where the parent serves the store the front ends share (cluster/local.py)."""
        return os.path.join(self.socket_dir, "store.sock")

    def at(self, index: int) -> FrontendPlan:
        return FrontendPlan(index, self.count, self.socket_dir, self.token, self.parent_pid)


def worker_sockets(plan: FrontendPlan | None) -> tuple[str, str, str]:
    """(socket folder, where this front end takes local workers, what local workers connect to). One
    front end: a folder of its own; several: the parent's, and the workers join every front end."""
    if plan is None:
        folder = tempfile.mkdtemp(prefix="inferd-")
        address = f"unix:{os.path.join(folder, 'workers.sock')}"
        return folder, address, address
    return plan.socket_dir, plan.worker_address(plan.index), plan.worker_addresses()
