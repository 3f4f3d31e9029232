"""The other front ends of the server, as this one reaches them: its channel (frontends/channel.py) and
where each other front end listens on theirs.

- **One host** (`inferd serve --frontends N`, the parent's store): front end i listens on its Unix socket
  in the plan's folder, with the plan's token; its id is `i`.
- **Many hosts** (a shared store, cluster/members.py): each front end also listens on TCP (at its
  `--worker-host`, the address the other hosts reach it by, a port the system picks) with the cluster's
  join token, and writes that address into its record `frontend/<id>` once it listens; the others read
  it from there. Plain TCP, so only where the worker port takes the join token over plain TCP too (no
  TLS on it, and a loopback `--worker-host` or `--insecure`): the token never crosses a network the
  server was told to encrypt. A front end with no join token, or with TLS on its worker port, listens on
  its Unix socket only, which its own host's front ends reach; the others' forwarded writes then get 503
  naming why.
- **Alone**: no channel.
"""

from __future__ import annotations

import contextlib
import logging

import msgspec

from inferd.cluster.members import Membership
from inferd.cluster.store import StoreError
from inferd.config import ServerConfig
from inferd.config.identity import frontend_id
from inferd.frontends.channel import UNIX, FrontendChannel, tcp_host
from inferd.frontends.plan import FrontendPlan
from inferd.tls import plain_join_allowed, worker_cert

log = logging.getLogger("inferd.frontends")


class Peers:
    def __init__(
        self, config: ServerConfig, plan: FrontendPlan | None, members: Membership | None, max_bytes: int
    ) -> None:
        self.config = config
        self.plan = plan
        self.members = members
        join = config.join_token.get_secret_value() if config.join_token else ""
        self.channel = FrontendChannel(
            plan.token if plan else "",
            plan.channel_path(plan.index) if plan else None,
            join if members is not None else "",
            max_bytes,
        )

    async def open(self) -> None:
        """Listen for the others' requests; on a shared store, say where in this front end's record."""
        members, config = self.members, self.config
        plain = worker_cert(config) is None and plain_join_allowed(config.worker_host, tls=False, insecure=config.insecure)
        tcp = tcp_host(config.worker_host, frontend_id(config)) if members is not None and plain else None
        await self.channel.open(tcp)
        if members is None:
            return
        if tcp is None or not self.channel.join_token:
            log.warning(
                "front ends on other hosts cannot forward search writes to this one: it needs a join token "
                "(INFERD_JOIN_TOKEN), a --worker-host they reach, and plain TCP there (no TLS on the worker "
                "port; --insecure off loopback)"
            )
        if (address := self.channel.address()) is not None:
            with contextlib.suppress(StoreError):  # written with the next renewal otherwise
                await members.publish(msgspec.structs.replace(members.me, channel=address))

    def address(self, frontend: str) -> str | None:
        """Where front end `frontend` (its id) takes this one's requests: its record's address on a shared
        store, its Unix socket among one host's front ends. None: not known (its record expired)."""
        if self.members is not None:
            member = self.members.members.get(frontend)
            if member is None or member.channel is None:
                return None
            elsewhere = member.host != self.members.me.host  # its Unix socket is no address from here
            return None if elsewhere and member.channel.startswith(UNIX) else member.channel
        if self.plan is not None and frontend.isdigit() and int(frontend) < self.plan.count:
            return self.plan.channel_address(int(frontend))
        return None

    def close(self) -> None:
        self.channel.close()


def peers_of(
    config: ServerConfig, plan: FrontendPlan | None, members: Membership | None, max_bytes: int
) -> Peers | None:
    """A front end's peers; None alone (no other front end to forward to)."""
    return None if plan is None and members is None else Peers(config, plan, members, max_bytes)
