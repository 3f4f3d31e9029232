"""Tenants and API keys through a real `inferd serve` with a config file of two tenants: urllib on the
OIP routes and the openai client on the OpenAI routes. Good keys pass; missing, unknown and expired ones
get 401 in each API's error shape; a model outside a tenant's list 403; probes stay open; reload by
SIGHUP and by the admin API swaps keys and refuses a broken file whole; keys never reach the log."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from inferd.gateway.keys import key_digest, new_key
from tests.conftest import ROOT, ServerProc, start_server

KEY_A = new_key()
KEY_B = new_key()
KEY_EXPIRED = new_key()
KEY_A2 = new_key()
WRONG = new_key()
ALL_KEYS = (KEY_A, KEY_B, KEY_EXPIRED, KEY_A2, WRONG)


def tenants_toml(alpha_key: str, metrics_require_key: bool = False) -> str:
    return (
        f"[gateway]\nmetrics_require_key = {str(metrics_require_key).lower()}\n"
        f'[tenants.alpha]\nmodels = ["sim", "sim-llm"]\napi_key_sha256 = ["{key_digest(alpha_key)}"]\n'
        f'[tenants.beta]\nmodels = ["sim"]\napi_key_sha256 = [\n  "{key_digest(KEY_B)}",\n'
        f'  {{ sha256 = "{key_digest(KEY_EXPIRED)}", expires = 2020-01-01T00:00:00Z }},\n]\n'
    )


def make_repo(root: Path) -> Path:
    repo = root / "repo"
    for name, toml in {
        "sim": 'builtin = "sim"\n',
        "other": 'builtin = "sim"\n',
        "sim-llm": 'builtin = "sim-llm"\n',
    }.items():
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(toml)
    return repo


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("auth") / "inferd.toml"


@pytest.fixture(scope="module")
def server(config_path: Path) -> Iterator[ServerProc]:
    root = config_path.parent
    config_path.write_text(tenants_toml(KEY_A))
    s = start_server(
        root,
        *("--model-repo", str(make_repo(root)), "--config", str(config_path)),
        *("--access-log", "--log-level", "DEBUG"),  # every line a request could leave in the log
    )
    yield s
    assert s.stop() in (0, -15)


BODIES: list[bytes] = []
"""Every response body the tests read: none may echo a key."""


def http(
    server: ServerProc, method: str, path: str, headers: dict[str, str] | None = None, body: Any = None
) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{server.url}{path}", data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, got, out = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        status, got, out = err.code, dict(err.headers), err.read()
    BODIES.append(out)
    return status, {k.lower(): v for k, v in got.items()}, out


def infer(server: ServerProc, model: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    body = {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
    return http(server, "POST", f"/v2/models/{model}/infer", headers, body)


def client(server: ServerProc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def chat(server: ServerProc, key: str, model: str = "sim-llm") -> str:
    reply = client(server, key).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    return reply.choices[0].message.content or ""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_good_keys_are_served_on_oip_and_openai_routes(server: ServerProc) -> None:
    assert infer(server, "sim", bearer(KEY_A))[0] == 200
    assert infer(server, "sim", {"X-API-Key": KEY_B})[0] == 200
    assert chat(server, KEY_A)
    assert [m.id for m in client(server, KEY_B).models.list()] == ["sim"]
    assert [m.id for m in client(server, KEY_A).models.list()] == ["sim", "sim-llm"]


def test_missing_unknown_and_expired_keys_get_401_in_each_apis_error_shape(server: ServerProc) -> None:
    for headers in ({}, bearer(WRONG), {"X-API-Key": KEY_EXPIRED}, {"X-Tenant": "alpha"}):
        status, got, body = infer(server, "sim", headers)
        assert status == 401 and got["www-authenticate"] == "Bearer"
        assert set(json.loads(body)) == {"error", "request_id"} and isinstance(json.loads(body)["error"], str)
        status, got, body = http(server, "POST", "/v1/chat/completions", headers, {"model": "sim-llm"})
        assert status == 401 and got["www-authenticate"] == "Bearer"
        error = json.loads(body)["error"]
        assert error["code"] == "Unauthorized" and error["type"] == "invalid_request_error"
    assert "expired" in json.loads(infer(server, "sim", bearer(KEY_EXPIRED))[2])["error"]
    for key in (WRONG, KEY_EXPIRED):
        with pytest.raises(openai.AuthenticationError):
            chat(server, key)


def test_a_model_outside_the_tenants_list_is_403_and_unknown_ones_404_name_only_its_models(
    server: ServerProc,
) -> None:
    with pytest.raises(openai.PermissionDeniedError, match="'beta' may not call model 'sim-llm'"):
        chat(server, KEY_B)
    status, _, body = infer(server, "other", bearer(KEY_A))
    assert status == 403 and "may not call model 'other'" in json.loads(body)["error"]
    assert http(server, "GET", "/v2/models/other", bearer(KEY_A))[0] == 403
    with pytest.raises(openai.NotFoundError) as err:
        chat(server, KEY_B, "nope")
    message = err.value.body["message"]  # type: ignore[index]
    assert "served models: ['sim']" in message and "sim-llm" not in message and "other" not in message
    status, _, body = infer(server, "nope", bearer(KEY_A))
    assert status == 404 and json.loads(body)["error"].endswith("served models: ['sim', 'sim-llm']")


def test_probes_and_the_api_description_stay_open_and_metrics_too_by_default(server: ServerProc) -> None:
    for path in ("/v2/health/live", "/v2/health/ready", "/openapi.json", "/metrics"):
        assert http(server, "GET", path)[0] == 200, path


def test_x_tenant_is_ignored_when_keys_name_the_tenant(server: ServerProc) -> None:
    """Without tenants an X-Tenant over 256 characters is a 400; with them it is not even read."""
    headers = {**bearer(KEY_A), "X-Tenant": "x" * 300}
    status, _, body = http(
        server, "POST", "/v1/completions", headers, {"model": "sim-llm", "prompt": "hi", "max_tokens": 2}
    )
    assert status == 200, body


def test_requests_are_counted_per_tenant_and_outcome(server: ServerProc) -> None:
    infer(server, "other", {"X-API-Key": KEY_B})
    text = http(server, "GET", "/metrics")[2].decode()
    ok = re.search(r'^inferd_tenant_requests_total\{outcome="ok",tenant="alpha"\} (\d+)', text, re.M)
    forbidden = re.search(
        r'^inferd_tenant_requests_total\{outcome="forbidden",tenant="beta"\} (\d+)', text, re.M
    )
    assert ok and float(ok.group(1)) >= 2 and forbidden and float(forbidden.group(1)) >= 1


def wait_until(check: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.05)


def admin_reload(server: ServerProc) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"{server.admin_url}/admin/reload", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_reload_by_sighup_and_admin_swaps_keys_and_refuses_a_broken_file(
    server: ServerProc, config_path: Path
) -> None:
    config_path.write_text(tenants_toml(KEY_A2))  # alpha's key rotated
    server.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: infer(server, "sim", bearer(KEY_A2))[0] == 200, "the new key works after SIGHUP")
    assert infer(server, "sim", bearer(KEY_A))[0] == 401

    config_path.write_text(tenants_toml(KEY_A) + '[tenants.gamma]\nmodels = ["nope"]\n')
    server.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "SIGHUP: config not reloaded" in server.log(), "the broken file is refused")
    assert infer(server, "sim", bearer(KEY_A2))[0] == 200 and infer(server, "sim", bearer(KEY_A))[0] == 401

    status, answer = admin_reload(server)  # still the broken file
    assert status == 400 and "[tenants.gamma] models lists ['nope']" in answer["error"]
    assert "served models: ['other', 'sim', 'sim-llm']" in answer["error"]
    assert infer(server, "sim", bearer(KEY_A2))[0] == 200

    config_path.write_text(tenants_toml(KEY_A, metrics_require_key=True))
    status, answer = admin_reload(server)
    assert status == 200 and answer["tenants"] == ["alpha", "beta"] and answer["keys"] == 3
    assert infer(server, "sim", bearer(KEY_A))[0] == 200 and infer(server, "sim", bearer(KEY_A2))[0] == 401
    assert http(server, "GET", "/metrics")[0] == 401
    assert http(server, "GET", "/metrics", {"X-API-Key": KEY_B})[0] == 200
    assert http(server, "GET", "/v2/health/ready")[0] == 200


def test_no_key_ever_reaches_the_log_or_a_response_body(server: ServerProc) -> None:
    for key in ALL_KEYS:
        infer(server, "sim", bearer(key))
        infer(server, "sim-llm", {"X-API-Key": key})
        http(server, "GET", "/metrics", {"Authorization": f"Basic {key}"})
    log = server.log()
    assert "/v2/models/sim/infer status=401" in log and "/v2/models/sim/infer status=200" in log
    assert "tenants ['alpha', 'beta']" in log  # the gateway did log its settings
    for key in ALL_KEYS:
        assert key not in log and key_digest(key) not in log  # nor the digests of the config file
        assert all(key.encode() not in body for body in BODIES)


def test_a_tenant_listing_an_unserved_model_is_a_startup_error_naming_the_served_ones(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[tenants.alpha]\nmodels = ["nope"]\napi_key_sha256 = ["{key_digest(KEY_A)}"]\n')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferd.cli.main",
            "serve",
            "--model-repo",
            str(make_repo(tmp_path)),
            "--config",
            str(bad),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 2
    assert "[tenants.alpha] models lists ['nope']" in done.stderr
    assert "served models: ['other', 'sim', 'sim-llm']" in done.stderr
