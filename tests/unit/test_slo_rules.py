"""`inferd slo rules`: the written rules pass `promtool check rules`, and `promtool test rules` runs
tests/data/slo/rules_test.yml against them (each alert made to fire and not to fire). promtool is a
test dependency (Debian's prometheus package, installed by scripts/setup --test): without it these
tests fail, they never skip."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from inferd.cli.main import app
from inferd.observability.slo_config import SloConfig
from inferd.observability.slo_rules import BURN_ALERTS, rules_document, rules_yaml

DATA = Path(__file__).resolve().parents[1] / "data" / "slo"
RULES_TEST_SLOS = {
    "sim": SloConfig(latency_ms=100),
    "chat": SloConfig(latency_ms=5000, ttft_ms=300, itl_ms=40),
}
"""The SLOs tests/data/slo/rules_test.yml was written for."""


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: apt-get install prometheus (scripts/setup --test installs it)")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60, check=False)


def test_each_model_slo_gets_three_burn_alerts_at_its_own_budget() -> None:
    doc = rules_document({"sim": SloConfig(availability=0.99)})
    records, all_alerts = (g["rules"] for g in doc["groups"])
    assert [(a["labels"]["slo"], a["alert"]) for a in all_alerts] == [
        (slo, b.alert) for slo in ("availability", "latency") for b in BURN_ALERTS
    ]
    alerts = all_alerts[:3]
    assert [r["record"] for r in records] == [
        f"inferd:slo_error_ratio:rate{w}" for w in ("5m", "30m", "1h", "6h", "3d")
    ]
    assert [a["alert"] for a in alerts] == [b.alert for b in BURN_ALERTS]
    assert [a["labels"]["severity"] for a in alerts] == ["page", "page", "ticket"]
    assert alerts[0]["expr"] == (
        'inferd:slo_error_ratio:rate1h{model="sim",slo="availability"} > 0.144'
        ' and inferd:slo_error_ratio:rate5m{model="sim",slo="availability"} > 0.144'
    )
    assert "rate6h" in alerts[1]["expr"] and "rate30m" in alerts[1]["expr"] and "> 0.06" in alerts[1]["expr"]
    assert "rate3d" in alerts[2]["expr"] and "rate6h" in alerts[2]["expr"] and "> 0.01" in alerts[2]["expr"]


def test_rules_of_the_configured_slos_pass_promtool_check(tmp_path: Path) -> None:
    config = tmp_path / "inferd.toml"
    config.write_text(
        "[models.sim.slo]\nlatency_ms = 100\n"
        '[models."sim-llm".slo]\nlatency_ms = 5000\nttft_ms = 300\nitl_ms = 40\n'
    )
    out = tmp_path / "rules.yml"
    result = CliRunner().invoke(app, ["slo", "rules", "--config", str(config), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert 'model=\\"sim-llm\\",slo=\\"itl\\"' in out.read_text()
    checked = run_promtool("check", "rules", str(out))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 23 rules found" in checked.stdout  # 5 records, 3 alerts x (2 + 4) SLOs


def test_promtool_unit_tests_make_each_alert_fire_and_not_fire(tmp_path: Path) -> None:
    shutil.copy(DATA / "rules_test.yml", tmp_path / "rules_test.yml")
    (tmp_path / "rules.yml").write_text(rules_yaml(RULES_TEST_SLOS))
    tested = run_promtool("test", "rules", str(tmp_path / "rules_test.yml"))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_rules_without_any_slo_table_are_refused_with_the_fix(tmp_path: Path) -> None:
    repo = tmp_path / "repo" / "sim"
    repo.mkdir(parents=True)
    (repo / "model.toml").write_text('builtin = "sim"\n')
    result = CliRunner().invoke(app, ["slo", "rules", "--model-repository", str(tmp_path / "repo")])
    assert result.exit_code == 2
    assert "no served model has an [slo] table" in result.output
