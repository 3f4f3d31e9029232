"""The Grafana dashboard of inferd's SLOs and serving metrics (`inferd slo dashboard`), built from the
same metric names the process exports and the recording rules `inferd slo rules` writes, so neither
can drift from the other: deploy/grafana/inferd.json is this module's output, and a test regenerates
it and checks each queried metric against a live registry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from inferd.observability.slo import BURN_RATE_METRIC, EVENTS_METRIC, OBJECTIVE_METRIC, THRESHOLD_METRIC
from inferd.observability.slo_rules import error_ratio_record

REQUESTS = "inferd_requests_total"
REJECTED = "inferd_requests_rejected_total"
DURATION = "inferd_request_duration_seconds"
TTFT = "inferd_time_to_first_token_seconds"
ITL = "inferd_inter_token_latency_seconds"
QUEUE_WAIT = "inferd_queue_wait_seconds"

SEL = 'model=~"$model"'
"""Every query's model filter (the dashboard's `model` variable)."""
BUDGET = f"(1 - max by (model, slo) ({OBJECTIVE_METRIC}{{{SEL}}}))"
"""Each model SLO's error budget, from the objective inferd exports."""


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    kind: str
    """Grafana panel type: timeseries or stat."""
    targets: tuple[tuple[str, str], ...]
    """(PromQL, legend) pairs."""
    unit: str = "short"
    description: str = ""


def _sum_rate(metric: str, by: str, match: str = "") -> str:
    inner = f"{SEL},{match}" if match else SEL
    return f"sum by ({by}) (rate({metric}{{{inner}}}[$__rate_interval]))"


def _quantile(q: float, metric: str, match: str = "") -> str:
    return f"histogram_quantile({q}, {_sum_rate(f'{metric}_bucket', 'model, le', match)})"


def _range_events(result: str | None = None) -> str:
    """SLI events of each model SLO over the dashboard's time range (only `result` ones, if given)."""
    match = SEL if result is None else f'{SEL},result="{result}"'
    return f"sum by (model, slo) (increase({EVENTS_METRIC}{{{match}}}[$__range]))"


SLO_PANELS = (
    Panel(
        "SLI over the dashboard's range",
        "stat",
        ((f"{_range_events('good')} / {_range_events()}", "{{model}} {{slo}}"),),
        "percentunit",
        "Share of good events per model SLO (docs/slo.md says what counts).",
    ),
    Panel(
        "Error budget left over the dashboard's range",
        "stat",
        (
            (
                f"1 - ({_range_events('bad')} / {_range_events()}) / on (model, slo) {BUDGET}",
                "{{model}} {{slo}}",
            ),
        ),
        "percentunit",
        "1: none of the budget spent; 0: all of it; below 0: the SLO is missed.",
    ),
    Panel(
        "Burn rate (recording rules)",
        "timeseries",
        tuple(
            (f"{error_ratio_record(w)}{{{SEL}}} / on (model, slo) {BUDGET}", f"{{{{model}}}} {{{{slo}}}} {w}")
            for w in ("5m", "1h", "6h")
        ),
        description="Error ratio over the error budget; alerts page at 14.4 (1h and 5m) and 6 (6h and 30m).",
    ),
    Panel(
        "Burn rate (in process)",
        "timeseries",
        ((f"{BURN_RATE_METRIC}{{{SEL}}}", "{{model}} {{slo}} {{window}} {{instance}}"),),
        description="Each inferd process's own 5m and 30m burn rates, without the rules.",
    ),
)

SERVING_PANELS = (
    Panel(
        "Requests by outcome",
        "timeseries",
        ((_sum_rate(REQUESTS, "model, outcome"), "{{model}} {{outcome}}"),),
        "reqps",
    ),
    Panel(
        "Refusals by reason",
        "timeseries",
        ((_sum_rate(REJECTED, "model, reason"), "{{model}} {{reason}}"),),
        "reqps",
        "Quota refusals are a tenant's own limit and do not count against availability.",
    ),
    Panel(
        "Requests by protocol",
        "timeseries",
        ((_sum_rate(REQUESTS, "model, protocol"), "{{model}} {{protocol}}"),),
        "reqps",
        "The edge each request came by: http (REST) or grpc.",
    ),
    Panel(
        "Request latency of successful requests",
        "timeseries",
        (
            (_quantile(0.5, DURATION, 'outcome="ok"'), "{{model}} p50"),
            (_quantile(0.99, DURATION, 'outcome="ok"'), "{{model}} p99"),
            (f'{THRESHOLD_METRIC}{{{SEL},slo="latency"}}', "{{model}} SLO threshold"),
        ),
        "s",
    ),
    Panel(
        "Time to first token",
        "timeseries",
        (
            (_quantile(0.99, TTFT), "{{model}} p99"),
            (f'{THRESHOLD_METRIC}{{{SEL},slo="ttft"}}', "{{model}} SLO threshold"),
        ),
        "s",
    ),
    Panel(
        "Inter-token latency",
        "timeseries",
        (
            (_quantile(0.99, ITL), "{{model}} p99"),
            (f'{THRESHOLD_METRIC}{{{SEL},slo="itl"}}', "{{model}} SLO threshold"),
        ),
        "s",
    ),
    Panel(
        "Queue wait",
        "timeseries",
        ((_quantile(0.99, QUEUE_WAIT), "{{model}} p99"),),
        "s",
    ),
)


def _panel(p: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    width = 12
    return {
        "id": panel_id,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}} if p.kind == "stat" else {},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": expr,
                "legendFormat": legend,
                **({"instant": True} if p.kind == "stat" else {}),
            }
            for i, (expr, legend) in enumerate(p.targets)
        ],
    }


def _row(title: str, panel_id: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
        "panels": [],
    }


def panels() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    y = 0
    for title, group in (("SLOs", SLO_PANELS), ("Serving", SERVING_PANELS)):
        out.append(_row(title, len(out) + 1, y))
        y += 1
        for i, p in enumerate(group):
            out.append(_panel(p, len(out) + 1, 12 * (i % 2), y + 8 * (i // 2)))
        y += 8 * ((len(group) + 1) // 2)
    return out


def dashboard() -> dict[str, Any]:
    return {
        "uid": "inferd-slo",
        "title": "inferd: SLOs and serving",
        "tags": ["inferd", "slo"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
                {
                    "name": "model",
                    "type": "query",
                    "label": "Model",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {"query": f"label_values({REQUESTS}, model)", "refId": "models"},
                    "definition": f"label_values({REQUESTS}, model)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels(),
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def queries() -> list[str]:
    """Every PromQL expression the dashboard runs (tests check each metric in them exists)."""
    found = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    return [*found, *(v["definition"] for v in dashboard()["templating"]["list"] if "definition" in v)]
