"""`inferd bench --protocol grpc` against a real `inferd serve --model sim`: a few hundred ModelInfer
calls, every answer's digest checked as REST's is, the edge's lifecycle record read from its trailers;
and the same load over REST on the same server, for the same counts."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from inferd.cli.main import app
from tests.conftest import ServerProc, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tmp_path_factory.mktemp("grpc_bench"), "--model", "sim", "--no-admin")
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
