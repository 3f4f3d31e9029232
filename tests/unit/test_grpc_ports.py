"""The gRPC listener's port sharing (grpc_edge/edge.py `server_options`): grpcio's `grpc.so_reuseport`
is off for a single front end, so a second listener on its port is refused at bind rather than silently
taking half its connections, and on for the front ends of `--frontends N`, which share the port (as
runner/parent.py's held socket does)."""

from __future__ import annotations

import pytest
from grpc import aio

from inferd.config import load_server_config
from inferd.grpc_edge.edge import server_options
from inferd.runner.parent import reuseport_socket


async def bind(port: int, reuseport: bool) -> tuple[aio.Server, int]:
    cfg = load_server_config(None, {"port": 0}, environ={})
    server = aio.server(options=server_options(cfg, reuseport))
    return server, server.add_insecure_port(f"127.0.0.1:{port}")


async def test_one_front_ends_grpc_port_is_its_own() -> None:
    first, port = await bind(0, reuseport=False)
    await first.start()
    try:
        with pytest.raises(RuntimeError, match=r"[Ff]ailed to bind"):
            await bind(port, reuseport=False)
        with pytest.raises(RuntimeError, match=r"[Ff]ailed to bind"):
            await bind(port, reuseport=True)  # a server that would share it cannot either
    finally:
        await first.stop(0)


async def test_the_front_ends_of_one_server_share_the_port_the_parent_holds() -> None:
    with reuseport_socket("127.0.0.1", 0) as held:
        port = held.getsockname()[1]
        servers = [(await bind(port, reuseport=True)) for _ in range(2)]
        try:
            assert [bound for _, bound in servers] == [port, port]
            for server, _ in servers:
                await server.start()
            with pytest.raises(RuntimeError, match=r"[Ff]ailed to bind"):
                await bind(port, reuseport=False)  # a single front end's listener cannot join them
        finally:
            for server, _ in servers:
                await server.stop(0)
