"""How a worker looks up a `dns:NAME:PORT` of --connect: every address NAME has (A and AAAA), through
the system resolver (`getaddrinfo`: /etc/hosts, then DNS; a Kubernetes headless Service answers with one
address per ready pod).

`--hosts-file PATH` (a test and operations override, hidden from `inferd worker --help`) reads the names
from a file in /etc/hosts format instead, read again at every lookup: tests change what a name resolves
to without root, and a host without DNS can be given its front ends in a file it rewrites.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

from inferd.worker.discovery import RESOLVE_EVERY_S, Name

RESOLVE_TIMEOUT_S = 2.0
"""Most time one lookup may take; a slower one counts as failed (the front ends joined stay)."""


@dataclass(frozen=True, slots=True)
class Resolver:
    hosts_file: Path | None = None
    """Resolve names from this /etc/hosts-format file instead of the system resolver."""
    every_s: float = RESOLVE_EVERY_S
    """How often each name is looked up again."""

    async def addresses(self, name: Name) -> list[str]:
        """NAME's addresses, sorted (none when it has none); OSError when the lookup fails (TimeoutError
        past RESOLVE_TIMEOUT_S, socket.gaierror for a name that does not exist)."""
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            if self.hosts_file is not None:
                return await asyncio.to_thread(in_hosts_file, self.hosts_file, name.host)
            infos = await asyncio.get_running_loop().getaddrinfo(
                name.host, name.port, type=socket.SOCK_STREAM
            )
        return sorted({str(info[4][0]) for info in infos})


def in_hosts_file(path: Path, host: str) -> list[str]:
    """The addresses `path` (/etc/hosts format: 'ADDRESS NAME [ALIAS...]', '#' comments) gives `host`;
    lines whose first field is not an IP address are skipped."""
    found: set[str] = set()
    for line in path.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) < 2 or host.lower() not in (f.lower() for f in fields[1:]):
            continue
        try:
            found.add(str(ipaddress.ip_address(fields[0])))
        except ValueError:
            continue
    return sorted(found)
