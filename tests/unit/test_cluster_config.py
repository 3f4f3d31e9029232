"""The `[cluster]` table and `inferd serve --store`: the URL's scheme, a password only from the
environment, the default from `[gateway] redis_url`, and a store that does not answer at start refused
with the fix; a rediss:// store verified with `[cluster] tls_ca_file`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from typer.testing import CliRunner

import inferd.gateway.config  # noqa: F401  (registers [gateway])
from inferd.cli.main import app
from inferd.cluster.config import check_cluster, cluster_config, open_store, store_url, with_store
from inferd.cluster.local import LocalStoreClient
from inferd.cluster.redis_store import RedisStore, without_password
from inferd.config import ConfigError, ServerConfig, load_server_config
from tests.conftest import ROOT, free_port
from tests.redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)


def loaded(tmp_path: Path, toml: str) -> ServerConfig:
    path = tmp_path / "inferd.toml"
    path.write_text(toml)
    return load_server_config(path, {}, environ={})


def test_the_cluster_table_has_defaults_and_no_store(tmp_path: Path) -> None:
    config = loaded(tmp_path, "")
    cluster = cluster_config(config)
    assert (cluster.store, cluster.name, cluster.lease_ttl_s, cluster.overprovisioning) == (None, "inferd", 5.0, 1.4)
    assert store_url(config) is None


def test_the_store_defaults_to_the_gateways_redis(tmp_path: Path) -> None:
    config = loaded(tmp_path, '[gateway]\nredis_url = "redis://cache:6379/0"\n')
    assert store_url(config) == "redis://cache:6379/0"
    own = loaded(tmp_path, '[gateway]\nredis_url = "redis://cache:6379/0"\n[cluster]\nstore = "rediss://state:6380/1"\n')
    assert store_url(own) == "rediss://state:6380/1"


def test_the_gateways_redis_as_the_store_is_checked_as_one(tmp_path: Path) -> None:
    """The default store is refused as [cluster] store would be: a password in the file, another scheme;
    and no error names the password."""
    with pytest.raises(ConfigError, match="INFERD_STORE_PASSWORD") as refused:
        check_cluster(loaded(tmp_path, '[gateway]\nredis_url = "redis://:hunter2@cache:6379/0"\n'))
    assert "hunter2" not in str(refused.value)
    with pytest.raises(ConfigError, match="must be redis://"):
        check_cluster(loaded(tmp_path, '[gateway]\nredis_url = "unix:///run/redis.sock"\n'))
    check_cluster(loaded(tmp_path, '[gateway]\nredis_url = "redis://cache:6379/0"\n[cluster]\nstore = "redis://s:1/0"\n'))
    assert without_password("rediss://user:hunter2@state:6380/1") == "rediss://state:6380/1"


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ('store = "http://redis:6379/0"', "must be redis://HOST:PORT/DB or rediss://"),
        ('store = "etcd://x:2379"', "not etcd://"),
        ('store = "redis://:hunter2@redis:6379/0"', "remove it from the URL and set INFERD_STORE_PASSWORD"),
        ('store = "redis:///0"', "names no host"),
        ('name = "a b{c}"', "[cluster] name"),
        ("overprovisioning = 0.9", "[cluster] overprovisioning 0.9 is below 1"),
        ("overprovisioning = nan", "Set it to 1 or more (default 1.4, Envoy's), or remove it"),
    ],
)
def test_a_bad_cluster_table_is_refused_with_the_fix(tmp_path: Path, table: str, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        loaded(tmp_path, f"[cluster]\n{table}\n")
    assert says in str(err.value)
    assert "hunter2" not in str(err.value)


def test_the_store_flag_overrides_the_file_and_refuses_a_password(tmp_path: Path) -> None:
    config = loaded(tmp_path, '[cluster]\nstore = "redis://file:6379/0"\nname = "blue"\n')
    flagged = with_store(config, "redis://flag:6379/2")
    assert store_url(flagged) == "redis://flag:6379/2" and cluster_config(flagged).name == "blue"
    with pytest.raises(ConfigError, match=r"--store must not hold the password.*INFERD_STORE_PASSWORD"):
        with_store(config, "redis://user:pw@flag:6379/0")
    result = CliRunner().invoke(app, ["serve", "--store", "memcached://x:11211"])
    assert result.exit_code == 2
    assert "--store 'memcached://x:11211' must be redis://HOST:PORT/DB" in result.output


async def test_no_store_or_the_parents_local_one_without_redis(tmp_path: Path) -> None:
    config = loaded(tmp_path, "")
    assert await open_store(config) is None
    local = await open_store(config, str(tmp_path / "store.sock"), "token")
    assert isinstance(local, LocalStoreClient)
    await local.close()


async def test_an_unreachable_store_is_refused_at_start_with_the_fix(tmp_path: Path) -> None:
    config = loaded(tmp_path, f'[cluster]\nstore = "redis://127.0.0.1:{free_port()}/0"\ntimeout_ms = 300\n')
    with pytest.raises(ConfigError) as err:
        await open_store(config)
    assert "failed its PING at start (timeout 300 ms)" in str(err.value)
    assert "ConnectionError" in str(err.value) and "Start it or fix [cluster] store / --store" in str(err.value)


@pytest.fixture
def redis_with_password() -> Iterator[RedisServer]:
    server = RedisServer(extra_args=("--requirepass", "s3cret"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_the_password_comes_from_the_environment(tmp_path: Path, redis_with_password: RedisServer) -> None:
    config = with_store(loaded(tmp_path, ""), redis_with_password.url)
    for environ in ({}, {"INFERD_STORE_PASSWORD": "wrong"}):
        with pytest.raises(ConfigError) as refused:
            await open_store(config, environ=environ)
        assert "AuthenticationError" in str(refused.value) and "set INFERD_STORE_PASSWORD" in str(refused.value)
    store = await open_store(config, environ={"INFERD_STORE_PASSWORD": "s3cret"})
    assert isinstance(store, RedisStore)
    try:
        assert await store.write("served", b"x") == 1
    finally:
        await store.close()


async def test_a_rediss_store_is_verified_with_the_configured_ca(tmp_path: Path) -> None:
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    issued.private_key_pem.write_to_path(tmp_path / "key.pem")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    other = trustme.CA()
    other.cert_pem.write_to_path(tmp_path / "other.pem")
    tls_port = free_port()
    server = RedisServer(
        extra_args=(
            "--tls-port", str(tls_port), "--tls-cert-file", str(tmp_path / "cert.pem"),
            "--tls-key-file", str(tmp_path / "key.pem"), "--tls-ca-cert-file", str(tmp_path / "ca.pem"),
            "--tls-auth-clients", "no",
        )
    )
    server.start()
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0"
        trusted = loaded(tmp_path, f'[cluster]\nstore = "{url}"\ntls_ca_file = "{tmp_path / "ca.pem"}"\n')
        store = await open_store(trusted)
        assert isinstance(store, RedisStore)
        try:
            assert await store.write("served", b"over tls") == 1
        finally:
            await store.close()
        untrusted = loaded(tmp_path, f'[cluster]\nstore = "{url}"\ntls_ca_file = "{tmp_path / "other.pem"}"\n')
        with pytest.raises(ConfigError) as refused:
            await open_store(untrusted)
        assert "certificate verify failed" in str(refused.value).lower()
    finally:
        server.stop()


WITHOUT_REDIS = """
import asyncio, sys
sys.modules["redis"] = None  # as if the inferd[redis] extra were not installed
from inferd.cli.main import app
from inferd.cluster.config import check_cluster, open_store, with_store
from inferd.cluster.local import LocalStoreClient
from inferd.config import ConfigError, load_server_config
import inferd.runner.parent

config = load_server_config(None, {}, environ={})
check_cluster(config)
store = asyncio.run(open_store(config, "/nonexistent/store.sock", "token"))
assert isinstance(store, LocalStoreClient)
try:
    check_cluster(with_store(config, "redis://127.0.0.1:6379/0"))
except ConfigError as exc:
    print(exc)
"""


def test_without_the_redis_package_the_local_store_works_and_a_redis_store_is_refused() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_REDIS], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "needs the redis package: install inferd with the redis extra" in done.stdout
