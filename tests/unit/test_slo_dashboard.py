"""deploy/grafana/inferd.json is exactly what `inferd slo dashboard` writes, and every metric it queries
is one inferd exports (or a recording rule `inferd slo rules` writes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from inferd.cli.main import app
from inferd.clock import FakeClock
from inferd.observability.metrics import Metrics
from inferd.observability.slo import BURN_RATE_METRIC, EVENTS_METRIC, OBJECTIVE_METRIC, THRESHOLD_METRIC
from inferd.observability.slo_config import SloConfig
from inferd.observability.slo_dashboard import dashboard_json, queries
from inferd.observability.slo_rules import rules_document

COMMITTED = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "inferd.json"
METRIC = re.compile(r"\b(inferd[_:][A-Za-z0-9_:]*)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every series name the registry exports, whether or not a label child exists yet."""
    return {f.name + suffix for f in registry.collect() for suffix in SUFFIXES.get(f.type, ("",))}


def test_the_committed_dashboard_is_what_the_command_writes(tmp_path: Path) -> None:
    out = tmp_path / "inferd.json"
    result = CliRunner().invoke(app, ["slo", "dashboard", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == dashboard_json()
    assert COMMITTED.read_text() == dashboard_json(), (
        "deploy/grafana/inferd.json is stale: run `inferd slo dashboard -o deploy/grafana/inferd.json`"
    )


def test_every_queried_metric_is_exported_or_recorded() -> None:
    metrics = Metrics({"chat": SloConfig(ttft_ms=300, itl_ms=40)}, FakeClock())
    recorded = {
        r["record"]
        for g in rules_document({"chat": SloConfig()})["groups"]
        for r in g["rules"]
        if "record" in r
    }
    known = exported_names(metrics.registry) | recorded
    queried = {name for expr in queries() for name in METRIC.findall(expr)}
    assert queried, "the dashboard queries nothing"
    assert queried <= known, f"queried but not exported: {sorted(queried - known)}"
    for slo_metric in (EVENTS_METRIC, BURN_RATE_METRIC, OBJECTIVE_METRIC, THRESHOLD_METRIC):
        assert slo_metric in queried, f"the dashboard shows no {slo_metric}"


def test_the_dashboard_is_grafana_json_with_unique_panel_ids() -> None:
    doc = json.loads(COMMITTED.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in doc["templating"]["list"]} == {"datasource", "model"}
    assert all(t["datasource"]["uid"] == "${datasource}" for p in doc["panels"] for t in p.get("targets", []))


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query (Grafana's variables filled in) as a recording rule's expression."""
    from tests.unit.test_slo_rules import run_promtool

    filled = [
        q.replace("$__rate_interval", "5m").replace("$__range", "1d").replace("$model", ".*")
        for q in queries()
        if not q.startswith("label_values(")
    ]
    rules = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"q{i}", "expr": q} for i, q in enumerate(filled)]}
        ]
    }
    path = tmp_path / "queries.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    checked = run_promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(filled)} rules found" in checked.stdout
