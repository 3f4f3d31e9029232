"""Hosts on one LAN, for tests of a server on many hosts: each host is a network namespace joined by a veth
pair to one bridge; the bridge holds the LAN's first address, so the test process (on the machine itself)
reaches every host, and every host reaches every other.

* `Lan.host(name)`: a new host (its namespace, its address); `Host.argv(argv)` runs a command there.
* `Host.cut()` / `Host.heal()`: lose every packet to and from the host (nftables in its namespace, as
  tests/netns.py does for one namespace), and back.
* `Lan.cut_off(hosts)` / `Lan.heal(hosts)`: a set of hosts (a zone) loses every packet to and from
  everything else, the machine itself included, while its hosts still reach one another; and back.
  `Host.dropped()` counts the packets a cut has dropped so far (a cut that drops nothing is no fault).
* `Host.resolve(names)`: what names resolve to inside the host (`ip netns exec` bind-mounts
  /etc/netns/NAME/hosts over /etc/hosts; the file is rewritten in place so a running process sees the
  change on its next lookup).

Names are unique per LAN, and `close` removes every namespace, veth pair, the bridge and /etc/netns files,
also after a test failed half-way. A missing `ip` or `nft` is an error, never a skip.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tests.netns import _run, require_tools

TABLE = "inferd_lan"
NETNS_ETC = Path("/etc/netns")


def _free_lan() -> str:
    """A /24 in 10.240.0.0/12 that no interface on the machine uses: its first three octets."""
    used = _run("ip", "-o", "-4", "addr", "show")
    for _ in range(100):
        prefix = f"10.{240 + secrets.randbelow(16)}.{secrets.randbelow(256)}"
        if f" {prefix}." not in used:
            return prefix
    raise RuntimeError("no free /24 in 10.240.0.0/12 for a test LAN")


class Host:
    def __init__(self, lan: Lan, name: str, address: str, tag: str) -> None:
        self.lan = lan
        self.name = name
        self.address = address
        self.netns = f"inferd-{name}-{tag}"[:60]
        self.host_if, self.ns_if = f"lh{tag}", f"ln{tag}"

    def create(self) -> None:
        _run("ip", "netns", "add", self.netns)
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _run("ip", "link", "set", self.ns_if, "netns", self.netns)
        _run("ip", "link", "set", self.host_if, "master", self.lan.bridge)
        _run("ip", "link", "set", self.host_if, "up")
        _run("ip", "-n", self.netns, "addr", "add", f"{self.address}/24", "dev", self.ns_if)
        _run("ip", "-n", self.netns, "link", "set", self.ns_if, "up")
        _run("ip", "-n", self.netns, "link", "set", "lo", "up")
        self.nft(f"add table inet {TABLE}")
        for chain, hook in (("incoming", "input"), ("outgoing", "output")):
            self.nft(f"add chain inet {TABLE} {chain} {{ type filter hook {hook} priority 0; policy accept; }}")

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run on this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def nft(self, command: str) -> None:
        _run(*self.argv(["nft", command]))

    def cut(self) -> None:
        """Lose every packet between this host and the LAN (its own loopback goes on)."""
        self.cut_except([])

    def cut_except(self, peers: Sequence[str]) -> None:
        """Lose every packet between this host and the LAN but those to and from `peers` (addresses)."""
        self.heal()
        keep = f"ip saddr != {{ {', '.join(peers)} }} " if peers else ""
        self.nft(f"add rule inet {TABLE} incoming iifname {self.ns_if} {keep}counter drop")
        keep = f"ip daddr != {{ {', '.join(peers)} }} " if peers else ""
        self.nft(f"add rule inet {TABLE} outgoing oifname {self.ns_if} {keep}counter drop")

    def heal(self) -> None:
        for chain in ("incoming", "outgoing"):
            self.nft(f"flush chain inet {TABLE} {chain}")

    def dropped(self) -> int:
        """Packets the current cut has dropped so far, both ways (0 once healed)."""
        listing = "".join(
            _run(*self.argv(["nft", "list", "chain", "inet", TABLE, chain])) for chain in ("incoming", "outgoing")
        )
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", listing))

    def resolve(self, names: dict[str, list[str]]) -> None:
        """Inside this host, each name resolves to its addresses (the file is rewritten in place)."""
        folder = NETNS_ETC / self.netns
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [f"{a} {n}" for n, addrs in names.items() for a in addrs]
        with open(folder / "hosts", "w") as f:  # same inode: a bind mount of it sees the new text
            f.write("\n".join(lines) + "\n")

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=10)
        shutil.rmtree(NETNS_ETC / self.netns, ignore_errors=True)


class Lan:
    """A bridge and the hosts on it; the machine itself is `gateway` (the LAN's .1)."""

    def __init__(self) -> None:
        require_tools("ip", "nft")
        self.tag = secrets.token_hex(3)
        self.bridge = f"lbr{self.tag}"
        self.prefix = _free_lan()
        self.gateway = f"{self.prefix}.1"
        self.hosts: list[Host] = []

    def __enter__(self) -> Lan:
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, name: str) -> Host:
        """A new host on the LAN, at the next address."""
        tag = f"{self.tag}{len(self.hosts):02d}"
        host = Host(self, name, f"{self.prefix}.{len(self.hosts) + 2}", tag)
        self.hosts.append(host)
        try:
            host.create()
        except BaseException:
            self.close()
            raise
        return host

    def cut_off(self, hosts: Sequence[Host]) -> None:
        """`hosts` lose every packet to and from every other host and the machine itself (the bridge's
        address); they still reach one another, as a zone cut off from the others does."""
        inside = [h.address for h in hosts]
        for host in hosts:
            host.cut_except(inside)

    def heal(self, hosts: Sequence[Host]) -> None:
        for host in hosts:
            host.heal()

    def close(self) -> None:
        """Remove every host and the bridge; safe to call twice, and after a failed create."""
        for host in self.hosts:
            with contextlib.suppress(Exception):
                host.close()
        self.hosts.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)
