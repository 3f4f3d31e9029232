"""`inferd bench --protocol grpc` and `inferd bench-llm --protocol grpc` against one real `inferd serve`
(sim and sim-llm): a few hundred ModelInfer calls, every answer's digest checked as REST's is, the edge's
lifecycle record read from its trailers, and the same load over REST on the same server for the same
counts; a couple of seconds of ModelStreamInfer streams with Triton's vLLM tensors, every stream's text
checked against sim-llm's."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from inferd.bench.llm_workload import LengthDist, LLMLoadSpec, plan_requests
from inferd.cli.main import app
from tests.conftest import ServerProc, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("grpc_bench")
    for name in ("sim", "sim-llm"):
        (root / "repo" / name).mkdir(parents=True)
        (root / "repo" / name / "model.toml").write_text(f'builtin = "{name}"\n')
    s = start_server(root, "--model-repo", str(root / "repo"), "--no-admin")
    yield s
    assert s.stop() in (0, -15)


def bench(*args: str) -> dict:
    base = ["bench", "--rate", "150", "--duration", "2", "--arrival", "constant", "--seed", "5", "--json"]
    result = CliRunner().invoke(app, [*base, *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_grpc_bench_checks_every_answer_against_the_sim_digest(server: ServerProc) -> None:
    report = bench("--protocol", "grpc", "--grpc-target", server.grpc_target, "--channels", "2", "--slo-ms", "1000")
    m = report["measured"]
    assert report["spec"]["protocol"] == "grpc" and report["spec"]["url"] == server.grpc_target
    assert report["sent"] == m["sent"] == 300
    assert (m["ok"], m["mismatched"], m["errors"]) == (300, 0, {})
    assert report["invariants"]["lost"] == report["invariants"]["duplicated"] == 0
    assert m["batch_size"]["mean"] >= 1 and m["queue_ms"]["p50"] is not None  # the edge's trailers
    assert m["goodput_rps"] > 0 and 0 < m["latency_ms"]["p50"] <= m["latency_ms"]["p99"]


def test_rest_on_the_same_server_counts_the_same(server: ServerProc) -> None:
    rest = bench("--url", server.url)
    assert rest["spec"]["protocol"] == "http"
    assert (rest["measured"]["ok"], rest["measured"]["mismatched"], rest["measured"]["errors"]) == (300, 0, {})


@pytest.mark.parametrize("streams", ["0", "2"])
def test_grpc_llm_streams_are_checked_and_timed(server: ServerProc, streams: str) -> None:
    """A stream per request (0), and every request on two long-lived streams matched by id (2)."""
    args = ["bench-llm", "--protocol", "grpc", "--grpc-target", server.grpc_target, "--streams", streams]
    args += ["--rate", "10"]
    args += ["--duration", "2", "--arrival", "constant", "--prompt-tokens", "8-32", "--output-tokens", "4-16"]
    result = CliRunner().invoke(app, [*args, "--seed", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    m = report["measured"]
    assert report["spec"]["protocol"] == "grpc" and report["spec"]["check"] is True
    assert (m["sent"], m["ok"], m["mismatched"], m["errors"]) == (20, 20, 0, {})
    plan = plan_requests(
        LLMLoadSpec(rate=10, duration_s=2, arrival="constant", prompt_tokens=LengthDist(8, 32),
                    output_tokens=LengthDist(4, 16), seed=2)
    )  # fmt: skip
    assert m["output_tokens"] == sum(r.max_tokens for r in plan)
    assert 0 < m["ttft_ms"]["p50"] <= m["ttft_ms"]["p99"] < 1500 and 0 < m["itl_ms"]["p50"] < 150
