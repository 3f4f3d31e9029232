"""A network namespace joined to the host by a veth pair, with nftables faults inside it.

The worker under test runs inside the namespace; the router listens on the host end of the veth. Faults
are nftables rules in the namespace's own table, matching only traffic to and from the host end, so
nothing else on the machine is touched:

* partition: drop everything;
* loss: drop a random share of packets, each way (``numgen random mod 100 < N``);
* heal: flush the rules.

Packets lost on a wire must look lost to the sender's TCP too (retransmission with exponential backoff).
Incoming packets are dropped in the input hook: the router's TCP never learns. An outgoing packet dropped
in the output hook would be a local drop the worker's own TCP sees (it then retries every 500 ms, without
backoff), so outgoing packets are marked instead, and the mark routes them into a sink: a second veth
pair inside the namespace whose far end discards them (they are addressed to a MAC nobody has). The
worker's TCP sees them leave and never acknowledged, as on a real network.

Names are unique per instance, and `close` removes the namespace (and with it the veth pair and the
table) even when a test failed half-way. A missing `ip` or `nft` is an error, never a skip.
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
from collections.abc import Sequence

TABLE = "inferd_fault"
SINK_MARK = "0x1"
SINK_TABLE = "100"


def require_tools(*tools: str) -> None:
    """Raise (the test fails) when a tool is missing: `scripts/setup --test` installs them."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise RuntimeError(f"network fault tests need {missing}: run scripts/setup --test (as root)")


def _run(*argv: str) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def _free_subnet() -> tuple[str, str]:
    """A /30 in 10.200.0.0/13 that no interface on the host uses: (host address, namespace address)."""
    used = _run("ip", "-o", "-4", "addr", "show")
    for _ in range(100):
        a, b = 200 + secrets.randbelow(8), secrets.randbelow(256)
        c = 4 * secrets.randbelow(64)
        prefix = f"10.{a}.{b}."
        if f"{prefix}{c + 1}/" not in used and f"{prefix}{c + 2}/" not in used:
            return f"{prefix}{c + 1}", f"{prefix}{c + 2}"
    raise RuntimeError("no free /30 in 10.200.0.0/13 for a test veth pair")


class NetNs:
    """One namespace and its veth pair: host_addr on the host side, ns_addr inside."""

    def __init__(self) -> None:
        require_tools("ip", "nft")
        tag = secrets.token_hex(4)
        self.name = f"inferd-nf-{tag}"
        # interface names: 15 characters at most
        self.host_if, self.ns_if, self.sink_if = f"nfh{tag}", f"nfw{tag}", f"nfs{tag}"
        self.host_addr, self.ns_addr = _free_subnet()
        self._created = False

    def __enter__(self) -> NetNs:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        _run("ip", "netns", "add", self.name)
        self._created = True
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _run("ip", "link", "set", self.ns_if, "netns", self.name)
        _run("ip", "addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        _run("ip", "-n", self.name, "addr", "add", f"{self.ns_addr}/30", "dev", self.ns_if)
        _run("ip", "-n", self.name, "link", "set", self.ns_if, "up")
        _run("ip", "-n", self.name, "link", "set", "lo", "up")
        self.nft(f"add table inet {TABLE}")
        for chain, hook in (("incoming", "input"), ("outgoing", "output")):
            self.nft(
                f"add chain inet {TABLE} {chain} {{ type filter hook {hook} priority 0; policy accept; }}"
            )

    def close(self) -> None:
        """Remove the namespace and the veth pair; safe to call twice, and after a failed create."""
        if shutil.which("ip") is None:
            return
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=10)
        if self._created:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)
            self._created = False

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def nft(self, command: str) -> None:
        _run(*self.argv(["nft", command]))

    # ---- faults ------------------------------------------------------------------------------------------
    def partition(self) -> None:
        """Lose every packet between the namespace and the host end."""
        self._drop("")

    def loss(self, percent: int) -> None:
        """Lose `percent` % of the packets each way, at random."""
        self._drop(f"numgen random mod 100 < {percent} ")

    def heal(self) -> None:
        for chain in ("incoming", "outgoing"):
            self.nft(f"flush chain inet {TABLE} {chain}")

    def _drop(self, match: str) -> None:
        self.heal()
        self.nft(f"add rule inet {TABLE} incoming ip saddr {self.host_addr} {match}counter drop")
        self.nft(
            f"add rule inet {TABLE} outgoing ip daddr {self.host_addr} {match}counter meta mark set {SINK_MARK}"
        )

    def lost_packets(self) -> tuple[int, int]:
        """Packets the current fault has dropped so far: (from the host end, to the host end)."""
        counts = []
        for chain in ("incoming", "outgoing"):
            listing = _run(*self.argv(["nft", "list", "chain", "inet", TABLE, chain]))
            counts.append(sum(int(n) for n in re.findall(r"counter packets (\d+)", listing)))
        return counts[0], counts[1]
