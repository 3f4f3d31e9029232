"""Prometheus recording and alerting rules for the configured SLOs (`inferd slo rules`), as the SRE
workbook's multiwindow, multi-burn-rate alerts:

    page    14.4x the budget's even burn over 1h, confirmed over 5m   (2% of a 30-day budget in 1 h)
    page     6x   over 6h, confirmed over 30m                         (5% in 6 h)
    ticket   1x   over 3d, confirmed over 6h                          (10% in 3 d)

Every window's error ratio is a recording rule over the `inferd_slo_events_total` counters (so a
restart of inferd loses nothing); each alert compares two of them with the model's own budget.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inferd.observability.slo import EVENTS_METRIC
from inferd.observability.slo_config import Objective, SloConfig

WINDOWS = ("5m", "30m", "1h", "6h", "3d")
"""Every window a recording rule computes the error ratio over."""
SLO_PERIOD_DAYS = 30
"""The period an error budget spans: a burn rate of 1 spends it exactly over this many days."""


def error_ratio_record(window: str) -> str:
    """The recording rule of the error ratio over `window`, by model and SLO."""
    return f"inferd:slo_error_ratio:rate{window}"


@dataclass(frozen=True, slots=True)
class BurnAlert:
    alert: str
    severity: str
    burn_rate: float
    long_window: str
    short_window: str


BURN_ALERTS = (
    BurnAlert("InferdSLOFastBurn", "page", 14.4, "1h", "5m"),
    BurnAlert("InferdSLOMediumBurn", "page", 6.0, "6h", "30m"),
    BurnAlert("InferdSLOSlowBurn", "ticket", 1.0, "3d", "6h"),
)

_SLO_WORDS = {
    "availability": "Requests failing on the server's side",
    "latency": "Successful requests slower than {ms} ms",
    "ttft": "Streams whose first token took longer than {ms} ms",
    "itl": "Tokens that came more than {ms} ms after the one before",
}


def recording_rules() -> list[dict[str, Any]]:
    by = "sum by (model, slo)"
    return [
        {
            "record": error_ratio_record(w),
            "expr": f'{by} (rate({EVENTS_METRIC}{{result="bad"}}[{w}])) / {by} (rate({EVENTS_METRIC}[{w}]))',
        }
        for w in WINDOWS
    ]


def number(value: float) -> str:
    """A PromQL literal without float noise (14.4 * 0.001 is 0.0144, not 0.014400000000000001)."""
    return f"{value:.6g}"


def burn_alert(model: str, o: Objective, a: BurnAlert) -> dict[str, Any]:
    threshold = number(a.burn_rate * o.error_budget)
    match = f'{{model="{model}",slo="{o.slo}"}}'
    what = _SLO_WORDS[o.slo].format(ms=number((o.threshold_s or 0.0) * 1000.0))
    budget_pct = number(o.error_budget * 100)
    days = f"{SLO_PERIOD_DAYS / a.burn_rate:.3g}"
    return {
        "alert": a.alert,
        "expr": (
            f"{error_ratio_record(a.long_window)}{match} > {threshold}"
            f" and {error_ratio_record(a.short_window)}{match} > {threshold}"
        ),
        # model and slo also come with the series; naming them keeps each rule distinct for promtool
        "labels": {"model": model, "slo": o.slo, "severity": a.severity, "burn_rate": number(a.burn_rate)},
        "annotations": {
            "summary": f"{model}: the {o.slo} SLO burns its error budget at {number(a.burn_rate)}x",
            "description": (
                f"{what}: more than {number(a.burn_rate)}x their {budget_pct}% budget over the last "
                f"{a.long_window} and {a.short_window}; at this rate the {SLO_PERIOD_DAYS}-day budget is "
                f"gone in {days} days."
            ),
        },
    }


def rules_document(slos: Mapping[str, SloConfig]) -> dict[str, Any]:
    """The rule file's content: recording rules for every window, three burn alerts per model SLO."""
    alerts = [
        burn_alert(model, o, a)
        for model, slo in sorted(slos.items())
        for o in slo.objectives()
        for a in BURN_ALERTS
    ]
    return {
        "groups": [
            {"name": "inferd-slo-error-ratios", "rules": recording_rules()},
            {"name": "inferd-slo-burn-alerts", "rules": alerts},
        ]
    }


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML of dicts, lists, strings and numbers; strings are JSON-quoted (valid YAML)."""
    pad = "  " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, dict | list) and item:
                lines.append(f"{pad}{key}:\n{to_yaml(item, indent + 1)}")
            else:
                lines.append(f"{pad}{key}: {_scalar(item)}")
        return "\n".join(lines)
    if isinstance(value, list):
        lines = []
        for item in value:
            body = to_yaml(item, indent + 1) if isinstance(item, dict | list) else f"{pad}  {_scalar(item)}"
            lines.append(f"{pad}- {body.lstrip()}")
        return "\n".join(lines)
    return pad + _scalar(value)


def _scalar(value: Any) -> str:
    if isinstance(value, dict | list):  # only empty ones get here
        return "{}" if isinstance(value, dict) else "[]"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int | float):
        return number(value)
    return json.dumps(str(value))


def rules_yaml(slos: Mapping[str, SloConfig]) -> str:
    header = (
        "# Prometheus rules for inferd's SLOs, written by `inferd slo rules` (docs/slo.md).\n"
        "# Check with `promtool check rules FILE`; load with rule_files in prometheus.yml.\n"
    )
    return header + to_yaml(rules_document(slos)) + "\n"
