"""Where pool links go: the hub of a real InferenceServer (no workers spawned) hands a pool worker's
pool link to its pool's manager, refuses an unknown pool and a bad token, and refuses a model link
whose pool is not its model's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from inferd.config import ServerConfig
from inferd.config.pools import PoolConfig
from inferd.models.sim import sim_config
from inferd.server import InferenceServer
from inferd.wire import protocol as p


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[InferenceServer, str]]:
    config = ServerConfig(port=0, admin_port=None, grpc_port=None, data_dir=tmp_path / "data",
                          pools={"p": PoolConfig(workers=0, memory_budget_mb=500)})
    models = [sim_config("a", pool="p", memory_mb=100), sim_config("own")]
    srv = InferenceServer(config, models, spawn_workers=False)
    await srv.hub.listen_unix(str(tmp_path / "w.sock"))
    yield srv, f"unix:{tmp_path / 'w.sock'}"
    await srv.hub.close()


async def welcome_of(address: str, hello: p.Hello) -> tuple[p.Welcome, asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await p.open_connection(address, None)
    writer.write(p.encode_frame(hello))
    async with asyncio.timeout(10.0):
        welcome = await p.read_message(reader)
    assert isinstance(welcome, p.Welcome)
    return welcome, reader, writer


def hello(server: InferenceServer, model: str = "", pool: str | None = "p", token: str | None = None) -> p.Hello:
    return p.Hello(worker_id="w0", model=model, pid=1, host="h", pool=pool,
                   token=server.hub.tokens[0] if token is None else token, credits=True)


async def test_a_pool_link_reaches_its_pools_manager(server: tuple[InferenceServer, str]) -> None:
    srv, address = server
    welcome, _, writer = await welcome_of(address, hello(srv))
    try:
        assert welcome.accepted and PoolConfig.model_validate_json(welcome.pool_config_json).memory_budget_mb == 500
        writer.write(p.encode_frame(p.PoolState(budget_mb=500.0, used_mb=0.0)))
        manager = srv.pools.managers["p"]
        async with asyncio.timeout(5.0):
            while "w0" not in manager.links or manager.links["w0"].state is None:  # noqa: ASYNC110 - the manager's table
                await asyncio.sleep(0.01)
        assert manager.wakeable("a", 1) is None
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("pool", "token", "reason"),
    [("q", None, "this server has no pool 'q' (its pools: p)"), ("p", "guess", "bad join token")],
)
async def test_a_pool_link_is_refused(server: tuple[InferenceServer, str], pool: str, token: str | None,
                                      reason: str) -> None:
    srv, address = server
    welcome, _, writer = await welcome_of(address, hello(srv, pool=pool, token=token))
    writer.close()
    assert not welcome.accepted and reason in welcome.reason


@pytest.mark.parametrize(
    ("model", "pool", "reason"),
    [
        ("a", None, "model 'a' is served by pool 'p': only that pool's workers serve it"),
        ("own", "p", "model 'own' is in no pool"),
    ],
)
async def test_a_model_link_of_another_pool_is_refused(
    server: tuple[InferenceServer, str], model: str, pool: str | None, reason: str
) -> None:
    srv, address = server
    welcome, _, writer = await welcome_of(address, hello(srv, model=model, pool=pool))
    writer.close()
    assert not welcome.accepted and reason in welcome.reason


async def test_a_model_link_of_its_pool_is_welcomed(server: tuple[InferenceServer, str]) -> None:
    srv, address = server
    welcome, _, writer = await welcome_of(address, hello(srv, model="a"))
    writer.close()
    assert welcome.accepted and b'"pool":"p"' in welcome.model_config_json
