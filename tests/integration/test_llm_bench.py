"""`inferd bench-llm` for ~2 s against a real server serving sim-llm: every stream checked against
sim_llm_tokens, sane counts and timings; and the static-batching policy served from a model.toml."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from inferd.bench.llm_loadgen import run_llm_load_blocking
from inferd.bench.llm_workload import LengthDist, LLMLoadSpec, plan_requests
from inferd.cli.main import app
from tests.conftest import ServerProc, start_server


def serve_sim_llm(root: Path, model_toml: str) -> ServerProc:
    repo = root / "repo"
    (repo / "sim-llm").mkdir(parents=True)
    (repo / "sim-llm" / "model.toml").write_text(model_toml)
    return start_server(root, "--model-repo", str(repo), "--no-admin")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = serve_sim_llm(tmp_path_factory.mktemp("llm_bench"), 'builtin = "sim-llm"\n')
    yield s
    assert s.stop() in (0, -15)


def test_bench_llm_command_checks_every_stream_against_sim_llm(server: ServerProc) -> None:
    args = ["bench-llm", "--url", server.url, "--rate", "10", "--duration", "2", "--arrival", "constant"]
    args += ["--prompt-tokens", "8-64", "--output-tokens", "4-24", "--seed", "3", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    m = report["measured"]
    assert report["spec"]["check"] is True
    assert report["sent"] == m["sent"] == 20
    assert (m["ok"], m["mismatched"], m["errors"]) == (20, 0, {})
    plan = plan_requests(
        LLMLoadSpec(
            rate=10,
            duration_s=2,
            arrival="constant",
            prompt_tokens=LengthDist(8, 64),
            output_tokens=LengthDist(4, 24),
            seed=3,
        )
    )
    assert m["output_tokens"] == sum(r.max_tokens for r in plan)
    assert m["prompt_tokens"] == sum(r.prompt_tokens for r in plan)
    # a lightly loaded sim-llm (5 ms steps) is well inside the default SLO
    assert m["good"] == 20 and m["goodput_rps"] > 0
    assert 0 < m["ttft_ms"]["p50"] <= m["ttft_ms"]["p99"] < 1500
    assert 0 < m["itl_ms"]["p50"] < 150 and 0 < m["tpot_ms"]["p50"] < 150
    assert m["ttft_ms"]["max"] < m["e2e_ms"]["max"]
    assert m["output_tokens_per_s"] > 0 and m["span_s"] >= 2


def test_static_policy_serves_correct_streams(tmp_path: Path) -> None:
    server = serve_sim_llm(tmp_path, 'builtin = "sim-llm"\n\n[params.scheduler]\npolicy = "static"\n')
    try:
        spec = LLMLoadSpec(
            url=server.url,
            rate=10,
            duration_s=1,
            arrival="constant",
            prompt_tokens=LengthDist(8, 32),
            output_tokens=LengthDist(4, 16),
        )
        report = run_llm_load_blocking(spec)
    finally:
        assert server.stop() in (0, -15)
    m = report.measured
    assert (m.sent, m.ok, m.mismatched, m.errors) == (10, 10, 0, {})
