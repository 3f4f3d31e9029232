"""Tenants and API keys: the key directory, the Auth layer's decisions, the tenant checks on models, the
reload of the config file, and `inferd keys new`."""

from __future__ import annotations

import hashlib
import tomllib
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from inferd.api.asgi import HttpRequest, HttpResponse
from inferd.api.http_call import MODEL_WORK, http_call, presented_key, read_hints
from inferd.api.middleware import Errors
from inferd.api.oip import encode_json
from inferd.cli.main import app as cli_app
from inferd.config import ConfigError, load_server_config
from inferd.config.tenants import KeyDigest, TenantConfig
from inferd.core.call import Call, chain
from inferd.core.tenant import ANONYMOUS, Tenant
from inferd.errors import Forbidden, NotFound, ServingError
from inferd.gateway.auth import (
    Auth,
    TenantRequests,
    allowed_models,
    check_model,
    tenant_counter,
)
from inferd.gateway.config import GatewayConfig, check_tenants, tenants_of
from inferd.gateway.keys import KEY_PREFIX, KeyDirectory, KeyStatus, key_digest, new_key
from inferd.gateway.reload import Gate, Gateway, build_gate

KEY_A = "ik-alpha-key-0001"
KEY_B = "ik-beta-key-0002"
KEY_OLD = "ik-beta-expired-0003"
EXPIRES = datetime(2027, 1, 1, tzinfo=UTC)


class WallClock:
    def __init__(self, now: float) -> None:
        self.t = now

    def __call__(self) -> float:
        return self.t


def tenants() -> dict[str, TenantConfig]:
    return {
        "alpha": TenantConfig(api_key_sha256=(key_digest(KEY_A),)),
        "beta": TenantConfig(
            api_key_sha256=(key_digest(KEY_B), KeyDigest(sha256=key_digest(KEY_OLD), expires=EXPIRES)),
            models=("sim",),
        ),
    }


def directory(now: float = EXPIRES.timestamp() - 1) -> KeyDirectory:
    return KeyDirectory(tenants(), WallClock(now))


# ---- keys and the directory ------------------------------------------------------------------------------
def test_a_new_key_is_prefixed_random_and_stored_as_its_sha256_hex() -> None:
    key = new_key()
    assert key.startswith(KEY_PREFIX) and len(key) > 40 and key != new_key()
    assert key_digest(key) == hashlib.sha256(key.encode()).hexdigest()
    TenantConfig(api_key_sha256=(key_digest(key),))  # the digest is what the config accepts


def test_the_directory_finds_each_key_tenant_and_says_why_it_refuses() -> None:
    d = directory()
    assert len(d) == 3
    ok = d.check(KEY_A)
    assert ok.status is KeyStatus.OK and ok.tenant is not None and ok.tenant.name == "alpha"
    assert d.check(KEY_B).tenant == Tenant("beta", tenants()["beta"])
    assert d.check(None).status is KeyStatus.MISSING
    assert d.check("").status is KeyStatus.MISSING
    assert d.check("ik-nobody").status is KeyStatus.UNKNOWN
    assert d.check(key_digest(KEY_A)).status is KeyStatus.UNKNOWN  # the digest is not a key


def test_a_key_is_refused_from_its_expiry_on_by_the_injected_wall_clock() -> None:
    clock = WallClock(EXPIRES.timestamp() - 0.5)
    d = KeyDirectory(tenants(), clock)
    assert d.check(KEY_OLD).status is KeyStatus.OK
    clock.t = EXPIRES.timestamp()
    assert d.check(KEY_OLD).status is KeyStatus.EXPIRED and d.check(KEY_OLD).tenant is None
    assert d.check(KEY_B).status is KeyStatus.OK  # the tenant's other key never expires


def test_an_expiry_without_a_time_zone_is_utc() -> None:
    naive = KeyDigest(sha256=key_digest(KEY_OLD), expires=datetime(2027, 1, 1))
    clock = WallClock(EXPIRES.timestamp())
    d = KeyDirectory({"beta": TenantConfig(api_key_sha256=(naive,))}, clock)
    assert d.check(KEY_OLD).status is KeyStatus.EXPIRED
    clock.t -= 1
    assert d.check(KEY_OLD).status is KeyStatus.OK


def test_one_key_listed_by_two_tenants_is_a_config_error() -> None:
    shared = TenantConfig(api_key_sha256=(key_digest(KEY_A),))
    with pytest.raises(ConfigError, match=r"'a' and 'b'.*make a new key"):
        KeyDirectory({"a": shared, "b": shared}, WallClock(0))


def test_a_key_instead_of_its_digest_is_refused_without_echoing_it(tmp_path: Path) -> None:
    path = tmp_path / "inferd.toml"
    path.write_text(f'[tenants.a]\napi_key_sha256 = ["{key_digest(KEY_A)}", "ik-this-is-a-secret-key"]\n')
    with pytest.raises(ConfigError, match="api_key_sha256 entry 2 is not 64 lowercase hex") as err:
        load_server_config(path, {}, environ={})
    assert "ik-this" not in str(err.value) and "secret" not in str(err.value)


# ---- config tables ---------------------------------------------------------------------------------------
def write_config(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def test_tenants_and_gateway_tables_load_from_the_config_file(tmp_path: Path) -> None:
    path = write_config(
        tmp_path / "inferd.toml",
        f'[gateway]\nmetrics_require_key = true\n[tenants.alpha]\napi_key_sha256 = ["{key_digest(KEY_A)}"]\n'
        f'[tenants.beta]\nmodels = ["sim"]\napi_key_sha256 = [\n  "{key_digest(KEY_B)}",\n'
        f'  {{ sha256 = "{key_digest(KEY_OLD)}", expires = 2027-01-01T00:00:00Z }},\n]\n',
    )
    config = load_server_config(path, {}, environ={})
    assert config.config_path == path
    assert tenants_of(config) == tenants()
    assert config.table("gateway") == GatewayConfig(metrics_require_key=True)
    assert tenants_of(load_server_config(None, {}, environ={})) == {}


def test_a_bad_tenant_name_is_refused_at_load(tmp_path: Path) -> None:
    path = write_config(tmp_path / "inferd.toml", '[tenants."a b"]\nmodels = []\n')
    with pytest.raises(ConfigError, match=r"\[tenants\] table.*rename"):
        load_server_config(path, {}, environ={})


def test_a_tenant_listing_an_unserved_model_is_refused_naming_the_served_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"\[tenants.beta\] models lists \['sim'\].*\['minilm', 'sim-llm'\]"
    ):
        check_tenants(tenants(), ["sim-llm", "minilm"])
    check_tenants(tenants(), ["sim"])


# ---- the Auth layer ----------------------------------------------------------------------------------------
def request(path: str, headers: dict[str, str] | None = None) -> HttpRequest:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope: dict[str, Any] = {"method": "POST", "path": path, "headers": raw}
    return HttpRequest(scope, peer=None, path_params={})  # type: ignore[arg-type]


def gate(tenants_: dict[str, TenantConfig] | None = None, **gateway: Any) -> Gate:
    return Gate(
        KeyDirectory(tenants() if tenants_ is None else tenants_, WallClock(0)), GatewayConfig(**gateway)
    )


def error_body(exc: ServingError, status: int) -> bytes:
    return encode_json({"error": exc.message})


async def through_auth(
    g: Gate, path: str, headers: dict[str, str] | None = None
) -> tuple[HttpResponse, Call]:
    async def handler(call: Call, request: object) -> HttpResponse:
        return HttpResponse(b"served")

    call = edge_call(g, path, headers)
    response = await chain([Errors, partial(Auth, gate=lambda: g)], handler)(call, None)
    assert isinstance(response, HttpResponse)
    return response, call


def edge_call(g: Gate, path: str, headers: dict[str, str] | None = None) -> Call:
    """The Call the HTTP edge reads from a request to `path` (its route), under gate `g`."""
    keys = g.enforced
    call = http_call(request(path, headers), error_body, path, keys)
    read_hints(call, request(path, headers), MODEL_WORK, keys)
    return call


async def test_a_good_key_in_either_header_names_the_tenant_of_the_call() -> None:
    for headers in (
        {"Authorization": f"Bearer {KEY_A}"},
        {"X-API-Key": KEY_A},
        {"authorization": f"bearer  {KEY_A}"},
    ):
        response, call = await through_auth(gate(), "/v2/models/sim/infer", headers)
        assert response.body == b"served"
        assert call.tenant is not None and call.tenant.name == "alpha"


async def test_missing_unknown_and_other_scheme_keys_get_401_with_www_authenticate_and_no_key() -> None:
    cases = [
        ({}, "API key is required"),
        ({"Authorization": "Bearer ik-wrong-secret-value"}, "not valid"),
        ({"X-API-Key": "ik-wrong-secret-value"}, "not valid"),
        ({"Authorization": f"Basic {KEY_A}"}, "API key is required"),
    ]
    for headers, message in cases:
        response, call = await through_auth(gate(), "/v1/chat/completions", headers)
        assert response.status == 401 and call.outcome == "unauthorized"
        assert response.header(b"www-authenticate") == b"Bearer"
        assert message in response.body.decode() and b"wrong-secret" not in response.body
        assert call.tenant is ANONYMOUS


async def test_open_routes_need_no_key_and_metrics_follows_the_gateway_setting() -> None:
    for path in ("/v2/health/live", "/v2/health/ready", "/openapi.json", "/metrics"):
        response, call = await through_auth(gate(), path)
        assert response.status == 200 and call.tenant is ANONYMOUS
    response, _ = await through_auth(gate(metrics_require_key=True), "/metrics")
    assert response.status == 401
    response, call = await through_auth(gate(metrics_require_key=True), "/metrics", {"X-API-Key": KEY_B})
    assert response.status == 200 and call.tenant is not None and call.tenant.name == "beta"


async def test_without_tenants_nothing_is_enforced_and_calls_carry_the_anonymous_tenant() -> None:
    response, call = await through_auth(gate({}), "/v2/models/sim/infer", {"X-API-Key": "anything"})
    assert response.status == 200 and call.tenant is ANONYMOUS and call.credential is None


async def test_without_tenants_x_tenant_names_the_anonymous_tenant_and_with_them_it_is_not_read() -> None:
    _, call = await through_auth(gate({}), "/v1/completions", {"X-Tenant": "team-a"})
    assert call.tenant.anonymous and call.tenant.name == "team-a"
    assert check_model(call.tenant, "other", lambda: ["sim"]) is None  # nothing enforced on it
    _, call = await through_auth(gate(), "/v1/completions", {"X-API-Key": KEY_A, "X-Tenant": "x" * 300})
    assert not call.tenant.anonymous and call.tenant.name == "alpha"


def test_an_x_tenant_over_256_characters_is_a_400_naming_it_without_tenants() -> None:
    with pytest.raises(ServingError, match="X-Tenant is 300 characters long; at most 256"):
        edge_call(gate({}), "/v1/completions", {"X-Tenant": "x" * 300})
    assert edge_call(gate({}), "/v1/completions", {"X-Tenant": "x" * 256}).tenant.name == "x" * 256


def test_the_edge_reads_the_key_only_when_tenants_are_configured() -> None:
    assert edge_call(gate(), "/v2", {"X-API-Key": "ik-x"}).credential == "ik-x"
    assert edge_call(gate({}), "/v2", {"X-API-Key": "ik-x"}).credential is None


def test_the_presented_key_is_the_header_bytes_as_sent() -> None:
    assert presented_key(request("/v2", {"X-API-Key": "  ik-x  "})) == "ik-x"
    scope: dict[str, Any] = {"method": "GET", "path": "/v2", "headers": [(b"x-api-key", "ik-é".encode())]}
    key = presented_key(HttpRequest(scope, None, {}))  # type: ignore[arg-type]
    assert key is not None
    d = KeyDirectory({"u": TenantConfig(api_key_sha256=(key_digest("ik-é"),))}, WallClock(0))
    assert d.check(key).status is KeyStatus.OK


async def test_tenant_requests_count_authenticated_calls_by_their_final_outcome() -> None:
    registry = CollectorRegistry()
    counter = tenant_counter(registry)

    async def handler(call: Call, request: object) -> HttpResponse:
        check_model(call.tenant, "sim-llm", lambda: ["sim", "sim-llm"])
        return HttpResponse(b"served")

    run = chain(
        [partial(TenantRequests, counter=counter), Errors, partial(Auth, gate=lambda: gate())], handler
    )
    for headers in ({"X-API-Key": KEY_A}, {"X-API-Key": KEY_A}, {"X-API-Key": KEY_B}, {}, {"X-API-Key": "x"}):
        await run(edge_call(gate(), "/v1/chat/completions", headers), None)

    def count(tenant: str, outcome: str) -> float | None:
        return registry.get_sample_value(
            "inferd_tenant_requests_total", {"tenant": tenant, "outcome": outcome}
        )

    assert count("alpha", "ok") == 2 and count("beta", "forbidden") == 1
    assert count("beta", "ok") is None and count("", "unauthorized") is None  # no tenant: not counted


# ---- models a tenant may call ----------------------------------------------------------------------------
def test_a_model_outside_the_list_is_403_and_an_unknown_one_404_naming_only_allowed_models() -> None:
    beta = Tenant("beta", tenants()["beta"])
    names = ["minilm", "sim", "sim-llm"]

    def served() -> list[str]:
        return names

    check_model(beta, "sim", served)
    check_model(ANONYMOUS, "anything", served)  # no tenants: the registry decides
    with pytest.raises(Forbidden, match=r"'beta' may not call model 'sim-llm'; it may call: \['sim'\]"):
        check_model(beta, "sim-llm", served)
    with pytest.raises(NotFound, match=r"served models: \['sim'\]$"):
        check_model(beta, "nope", served)
    alpha = Tenant("alpha", tenants()["alpha"])
    with pytest.raises(NotFound, match=r"\['minilm', 'sim', 'sim-llm'\]"):
        check_model(alpha, "nope", served)
    assert allowed_models(beta, names) == ["sim"] and allowed_models(alpha, names) == names


# ---- reload --------------------------------------------------------------------------------------------
def test_reload_swaps_tenants_and_keys_whole_and_refuses_a_bad_file_keeping_the_running_ones(
    tmp_path: Path,
) -> None:
    path = write_config(
        tmp_path / "inferd.toml", f'[tenants.alpha]\napi_key_sha256 = ["{key_digest(KEY_A)}"]\n'
    )
    gateway = Gateway(load_server_config(path, {}, environ={}), lambda: ["sim"], WallClock(0))
    first = gateway.current()
    assert first.directory.check(KEY_A).status is KeyStatus.OK

    write_config(path, f'[tenants.beta]\napi_key_sha256 = ["{key_digest(KEY_B)}"]\nmodels = ["sim"]\n')
    summary = gateway.reload()
    assert summary["tenants"] == ["beta"] and summary["keys"] == 1
    assert summary["gateway"]["metrics_require_key"] is False and summary["gateway"]["redis_url"] is None
    assert gateway.current().directory.check(KEY_A).status is KeyStatus.UNKNOWN
    assert gateway.current().directory.check(KEY_B).status is KeyStatus.OK
    assert first.directory.check(KEY_A).status is KeyStatus.OK  # a call holding the old gate is unchanged

    running = gateway.current()
    for broken in (
        f'[tenants.beta]\napi_key_sha256 = ["{KEY_B}"]\n',  # the key itself, not its digest
        f'[tenants.beta]\napi_key_sha256 = ["{key_digest(KEY_B)}"]\nmodels = ["nope"]\n',
        "[tenants.beta\n",
        "[gateway]\nmetrics_require_key = 3\n",
    ):
        write_config(path, broken)
        with pytest.raises(ConfigError) as err:
            gateway.reload()
        assert KEY_B not in str(err.value)
        assert gateway.current() is running


def test_reload_without_a_config_file_says_so() -> None:
    gateway = Gateway(load_server_config(None, {}, environ={}), lambda: [], WallClock(0))
    assert not gateway.current().enforced
    with pytest.raises(ConfigError, match="without --config"):
        gateway.reload()


def test_build_gate_checks_models_and_keys() -> None:
    config = load_server_config(None, {}, environ={})
    assert build_gate(config, [], WallClock(0)).summary()["tenants"] == []


# ---- inferd keys new -------------------------------------------------------------------------------------
def test_keys_new_prints_the_key_then_the_config_lines_that_let_it_in(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli_app, ["keys", "new", "acme"])
    assert result.exit_code == 0, result.output
    key, *config_lines = result.stdout.splitlines()
    assert key.startswith(KEY_PREFIX)
    table = tomllib.loads("\n".join(config_lines))
    assert table == {"tenants": {"acme": {"api_key_sha256": [key_digest(key)]}}}
    path = write_config(tmp_path / "inferd.toml", "\n".join(config_lines))
    d = KeyDirectory(tenants_of(load_server_config(path, {}, environ={})), WallClock(0))
    assert d.check(key).tenant == Tenant("acme", TenantConfig(api_key_sha256=(key_digest(key),)))


def test_keys_new_refuses_a_name_that_is_not_a_tenant_name() -> None:
    result = CliRunner().invoke(cli_app, ["keys", "new", "a b"])
    assert result.exit_code == 2 and "tenant name" in result.output
