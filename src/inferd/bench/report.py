"""What a load run measured: the per-phase `Recorder`, the frozen `LoadReport`, and its rendering
as a rich table or as JSON."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from hdrh.histogram import HdrHistogram
from rich.console import Console
from rich.table import Table

# Microsecond histograms from 1 us to 60 s, 3 significant digits.
_LOWEST_US = 1
_HIGHEST_US = 60_000_000
_DIGITS = 3
# Overload refusals (their latency: how fast overload is refused) and server timeouts, REST's and gRPC's.
REJECTIONS = {"http": ("http_429", "http_503"), "grpc": ("grpc_resource_exhausted", "grpc_unavailable")}
SERVER_TIMEOUT = {"http": "http_504", "grpc": "grpc_deadline_exceeded"}
MISMATCH_KINDS = ("wrong_id", "unknown_id", "wrong_digest")


def _histogram(highest: int = _HIGHEST_US) -> HdrHistogram:
    return HdrHistogram(_LOWEST_US, highest, _DIGITS)


def _header_float(headers: Mapping[str, str], name: str) -> float | None:
    value = headers.get(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


class Recorder:
    """Counts and histograms for one phase (warmup or measured). Cheap per call: it runs per request."""

    def __init__(self, slo_ms: float | None = None) -> None:
        self.latency_us = _histogram()
        self.overhead_us = _histogram()
        self.queue_us = _histogram()
        self.compute_us = _histogram()
        self.send_lag_us = _histogram()
        self.rejection_us = _histogram()
        self.batch_size = _histogram(highest=1_000_000)
        self.batch_costs: dict[int, list[float]] = {}
        """Batch size -> [answers, summed compute s, summed squared compute s] (each answer of a batch
        reports it once): what `--save-profile` fits a device's cost line to."""
        self.errors: Counter[str] = Counter()
        self.mismatches: Counter[str] = Counter()
        self.sent = 0
        self.ok_count = 0
        self.retried = 0
        self.within_slo = 0
        self.slo_us = None if slo_ms is None else slo_ms * 1000.0

    def send_lag(self, lag_s: float) -> None:
        self.sent += 1
        self.send_lag_us.record_value(max(0, int(lag_s * 1e6)))

    def error(self, kind: str, latency_s: float | None = None) -> None:
        self.errors[kind] += 1
        if latency_s is not None and kind in REJECTIONS["http"] + REJECTIONS["grpc"]:
            self.rejection_us.record_value(max(_LOWEST_US, int(latency_s * 1e6)))

    def mismatch(self, kind: str) -> None:
        self.mismatches[kind] += 1

    def ok(self, latency_s: float, headers: Mapping[str, str], send_lag_s: float = 0.0) -> None:
        self.ok_count += 1
        latency_us = latency_s * 1e6
        self.latency_us.record_value(max(_LOWEST_US, int(latency_us)))
        if self.slo_us is not None and latency_us <= self.slo_us:
            self.within_slo += 1
        # Framework overhead is the server's: counted from the actual send, not the intended one, so
        # the load generator's own lateness is not charged to the server (latency above still is).
        self._lifecycle(latency_us - max(0.0, send_lag_s) * 1e6, headers)

    def _lifecycle(self, latency_us: float, headers: Mapping[str, str]) -> None:
        queue_ms = _header_float(headers, "X-Inferd-Queue-Ms")
        compute_ms = _header_float(headers, "X-Inferd-Compute-Ms")
        batch = _header_float(headers, "X-Inferd-Batch-Size")
        attempts = _header_float(headers, "X-Inferd-Attempts")
        if queue_ms is not None:
            self.queue_us.record_value(max(0, int(queue_ms * 1000.0)))
        if compute_ms is not None:
            self.compute_us.record_value(max(0, int(compute_ms * 1000.0)))
        if queue_ms is not None and compute_ms is not None:
            overhead = latency_us - (queue_ms + compute_ms) * 1000.0
            self.overhead_us.record_value(max(0, int(overhead)))
        if batch is not None:
            self.batch_size.record_value(max(0, int(batch)))
            if compute_ms is not None:
                cost = self.batch_costs.setdefault(int(batch), [0, 0.0, 0.0])
                cost[0] += 1
                cost[1] += compute_ms / 1000.0
                cost[2] += (compute_ms / 1000.0) ** 2
        if attempts is not None and attempts > 1:
            self.retried += 1


def _ms(h: HdrHistogram, *percentiles: float) -> dict[str, float | None]:
    """Selected percentiles (and mean, max) of a microsecond histogram, in milliseconds."""
    empty = h.get_total_count() == 0
    values = {} if empty else h.get_percentile_to_value_dict(list(percentiles))
    out: dict[str, float | None] = {}
    for p in percentiles:
        key = "p" + f"{p:g}".replace(".", "")
        out[key] = None if empty else values[p] / 1000.0
    out["mean"] = None if empty else h.get_mean_value() / 1000.0
    out["max"] = None if empty else h.get_max_value() / 1000.0
    return out


@dataclass(frozen=True)
class PhaseReport:
    """One phase's numbers. Latencies are of ok answers, in ms, measured from the intended send time."""

    window_s: float
    sent: int
    offered_rps: float
    ok: int
    achieved_rps: float
    goodput_rps: float | None
    mismatched: int
    mismatch_kinds: dict[str, int]
    errors: dict[str, int]
    retried: int
    latency_ms: dict[str, float | None]
    overhead_ms: dict[str, float | None]
    queue_ms: dict[str, float | None]
    compute_ms: dict[str, float | None]
    batch_size: dict[str, float | None]
    send_lag_ms: dict[str, float | None]
    rejection_ms: dict[str, float | None]
    """Latency of 429/503 answers (from intended send time): how fast overload is refused."""
    latency_hdr: str
    """The latency histogram (us), HdrHistogram-encoded, for merging runs."""
    batch_costs: dict[int, list[float]]
    """Batch size -> [answers, summed compute s, summed squared compute s] (Recorder.batch_costs)."""

    @classmethod
    def from_recorder(cls, rec: Recorder, window_s: float) -> PhaseReport:
        batch = rec.batch_size
        batch_empty = batch.get_total_count() == 0
        return cls(
            window_s=window_s,
            sent=rec.sent,
            offered_rps=rec.sent / window_s,
            ok=rec.ok_count,
            achieved_rps=rec.ok_count / window_s,
            goodput_rps=None if rec.slo_us is None else rec.within_slo / window_s,
            mismatched=sum(rec.mismatches.values()),
            mismatch_kinds={kind: rec.mismatches[kind] for kind in MISMATCH_KINDS},
            errors=dict(sorted(rec.errors.items())),
            retried=rec.retried,
            latency_ms=_ms(rec.latency_us, 50, 90, 99, 99.9),
            overhead_ms=_ms(rec.overhead_us, 50, 99),
            queue_ms=_ms(rec.queue_us, 50, 99),
            compute_ms=_ms(rec.compute_us, 50, 99),
            batch_size={
                "mean": None if batch_empty else batch.get_mean_value(),
                "p50": None if batch_empty else float(batch.get_value_at_percentile(50)),
                "p99": None if batch_empty else float(batch.get_value_at_percentile(99)),
            },
            send_lag_ms=_ms(rec.send_lag_us, 50, 99),
            rejection_ms=_ms(rec.rejection_us, 50, 99),
            latency_hdr=rec.latency_us.encode().decode() if rec.latency_us.get_total_count() else "",
            batch_costs={n: list(c) for n, c in sorted(rec.batch_costs.items())},
        )

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_dict(self, include_histograms: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if not include_histograms:
            out.pop("latency_hdr")
        return out


@dataclass(frozen=True)
class ChaosReport:
    """What chaos injection did during the measured window (built by `inferd.bench.chaos`).

    Times are ms. `after_injection` covers the requests whose intended send time falls within
    `after_window_s` after any injection, `steady` all the others; each is
    {"sent", "ok", "failed", "latency_ms": {"p50", "p99", "max"}} with latencies of ok answers."""

    spec: dict[str, Any]
    planned: int
    injections: list[dict[str, Any]]
    """Each: n, at_s (from the window start), worker_id, pid, signal, ready_before, detect_s, replace_s."""
    skipped: dict[str, int]
    """Scheduled injections not made, by reason (admin_unavailable, no_local_ready_worker, ...)."""
    admin_errors: dict[str, int]
    detect_ms: dict[str, float | int | None]
    replace_ms: dict[str, float | int | None]
    after_injection: dict[str, Any]
    steady: dict[str, Any]
    stopped_pids: list[int]
    resumed_pids: list[int]
    """Stopped pids that still existed at the end and were sent SIGCONT."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LoadReport:
    """A whole run: the spec, what was sent, the measured phase, and the warmup phase if any."""

    spec: dict[str, Any]
    scheduled: int
    sent: int
    elapsed_s: float
    generator_cpu_s: float
    measured: PhaseReport
    warmup: PhaseReport | None
    chaos: ChaosReport | None = None

    @property
    def invariants(self) -> dict[str, Any]:
        """The counters that must stay at zero under failures, over the whole run (warmup included):

        lost: requests that got no answer at all (client deadline or hard stop, no response);
        duplicated: answers carrying an id no longer outstanding (already answered);
        misrouted: answers with another outstanding caller's id, or the wrong digest;
        timed_out: requests the server answered as past their deadline (HTTP 504, gRPC DEADLINE_EXCEEDED);
        errors: every error by kind (the above's `timeout` and `http_504` included)."""
        phases = [self.measured] + ([self.warmup] if self.warmup else [])
        errors: Counter[str] = Counter()
        kinds: Counter[str] = Counter()
        for phase in phases:
            errors.update(phase.errors)
            kinds.update(phase.mismatch_kinds)
        return {
            "lost": errors["timeout"],
            "duplicated": kinds["unknown_id"],
            "misrouted": kinds["wrong_id"] + kinds["wrong_digest"],
            "timed_out": errors["http_504"] + errors["grpc_deadline_exceeded"],
            "errors": dict(sorted(errors.items())),
        }

    @property
    def mismatched_total(self) -> int:
        """Mismatches in every phase: a wrong answer during warmup is still a wrong answer."""
        return self.measured.mismatched + (self.warmup.mismatched if self.warmup else 0)

    @property
    def cpu_us_per_request(self) -> float:
        return self.generator_cpu_s * 1e6 / max(1, self.sent)

    def to_dict(self, include_histograms: bool = False) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "scheduled": self.scheduled,
            "sent": self.sent,
            "elapsed_s": self.elapsed_s,
            "generator_cpu_s": self.generator_cpu_s,
            "generator_cpu_us_per_request": self.cpu_us_per_request,
            "mismatched_total": self.mismatched_total,
            "invariants": self.invariants,
            "measured": self.measured.to_dict(include_histograms),
            "warmup": self.warmup.to_dict(include_histograms) if self.warmup else None,
            "chaos": self.chaos.to_dict() if self.chaos else None,
        }


def to_json(report: LoadReport, include_histograms: bool = False) -> str:
    return json.dumps(report.to_dict(include_histograms), indent=2)


def _f(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:,.2f}{unit}"


def _phase_rows(p: PhaseReport, protocol: str) -> list[tuple[str, str]]:
    lat, ovh = p.latency_ms, p.overhead_ms
    kinds = ", ".join(f"{k} {v}" for k, v in p.mismatch_kinds.items())
    rows = [
        ("offered", f"{p.offered_rps:,.1f} req/s ({p.sent:,} sent in {p.window_s:g} s)"),
        ("achieved", f"{p.achieved_rps:,.1f} req/s"),
        ("ok", f"{p.ok:,}"),
        ("mismatched", f"{p.mismatched:,} ({kinds})"),
    ]
    if p.goodput_rps is not None:
        rows.insert(2, ("goodput (within SLO)", f"{p.goodput_rps:,.1f} req/s"))
    shown = (*REJECTIONS[protocol], SERVER_TIMEOUT[protocol], "timeout", "connection")
    errors = {kind: p.errors.get(kind, 0) for kind in shown} | p.errors
    rows += [(f"error {kind}", f"{count:,}") for kind, count in errors.items()]
    rows += [
        (
            "latency ms p50/p90/p99/p99.9/max",
            " / ".join(_f(lat[k]) for k in ("p50", "p90", "p99", "p999", "max")),
        ),
        ("overhead ms p50/p99", f"{_f(ovh['p50'])} / {_f(ovh['p99'])}"),
        ("queue ms mean/p50/p99", " / ".join(_f(p.queue_ms[k]) for k in ("mean", "p50", "p99"))),
        ("compute ms mean/p50/p99", " / ".join(_f(p.compute_ms[k]) for k in ("mean", "p50", "p99"))),
        ("batch size mean/p50/p99", " / ".join(_f(p.batch_size[k]) for k in ("mean", "p50", "p99"))),
        ("retried (attempts > 1)", f"{p.retried:,}"),
        ("send lag ms p99/max", f"{_f(p.send_lag_ms['p99'])} / {_f(p.send_lag_ms['max'])}"),
        ("refusals (429/503) in ms p50/p99", f"{_f(p.rejection_ms['p50'])} / {_f(p.rejection_ms['p99'])}"),
    ]
    return rows


def _invariant_rows(report: LoadReport) -> list[tuple[str, str, bool]]:
    """(name, value, bad): throughput and latency next to the counters that must stay at zero."""
    inv = report.invariants
    m = report.measured
    lat = m.latency_ms
    errors = ", ".join(f"{kind} {count:,}" for kind, count in inv["errors"].items()) or "none"
    return [
        ("throughput", f"{m.achieved_rps:,.1f} ok/s of {m.offered_rps:,.1f} offered", False),
        ("latency ms p50/p99/max", " / ".join(_f(lat[k]) for k in ("p50", "p99", "max")), False),
        ("LOST (no answer by the deadline)", f"{inv['lost']:,}", inv["lost"] > 0),
        ("DUPLICATED (id already answered)", f"{inv['duplicated']:,}", inv["duplicated"] > 0),
        ("MISROUTED (wrong id or digest)", f"{inv['misrouted']:,}", inv["misrouted"] > 0),
        ("TIMED OUT (server 504 / DEADLINE_EXCEEDED)", f"{inv['timed_out']:,}", inv["timed_out"] > 0),
        ("errors by kind (whole run)", errors, bool(inv["errors"])),
    ]


def _chaos_rows(c: ChaosReport) -> list[tuple[str, str, bool]]:
    spec = c.spec
    times = ", ".join(f"{inj['at_s']:.2f}" for inj in c.injections[:20])
    if len(c.injections) > 20:
        times += f", ... ({len(c.injections) - 20} more)"
    skipped = ", ".join(f"{k} {v}" for k, v in c.skipped.items()) or "none"
    admin = ", ".join(f"{k} {v}" for k, v in c.admin_errors.items()) or "none"

    def recovery(d: dict[str, float | int | None]) -> str:
        missing = f" ({d['missing']} not measured)" if d["missing"] else ""
        return f"{_f(d['p50'])} / {_f(d['max'])}{missing}"

    def window(w: dict[str, Any]) -> str:
        lat = w["latency_ms"]
        return f"{_f(lat['p99'])} (p50 {_f(lat['p50'])}, max {_f(lat['max'])}; {w['ok']:,}/{w['sent']:,} ok)"

    after = c.after_injection
    rows = [
        (
            f"chaos {spec['mode']}",
            f"every {spec['interval_s']:g} s from {spec['start_s']:g} s, admin {spec['admin_url']}",
            False,
        ),
        (
            "injections (made/planned)",
            f"{len(c.injections)} / {c.planned}",
            len(c.injections) < c.planned,
        ),
        ("injected at s", times or "-", False),
        ("skipped", skipped, bool(c.skipped)),
        ("admin errors", admin, bool(c.admin_errors)),
        ("time to detect ms p50/max", recovery(c.detect_ms), bool(c.detect_ms["missing"])),
        ("time to replace ms p50/max", recovery(c.replace_ms), bool(c.replace_ms["missing"])),
        (f"p99 ms after injections ({spec['after_window_s']:g} s)", window(after), after["failed"] > 0),
        ("p99 ms steady", window(c.steady), c.steady["failed"] > 0),
    ]
    if c.stopped_pids:
        gone = len(c.stopped_pids) - len(c.resumed_pids)
        resumed = f"{len(c.resumed_pids)} of {len(c.stopped_pids)} stopped ({gone} already gone)"
        rows.append(("stopped pids resumed (SIGCONT)", resumed, False))
    return rows


def render(report: LoadReport, console: Console | None = None) -> None:
    """Print the report as a table: the measured window, then warmup and generator lines."""
    spec = report.spec
    protocol = spec.get("protocol", "http")
    title = f"inferd bench: {spec['arrival']} {spec['rate']:g} req/s -> {spec['url']} ({protocol}) model {spec['model']}"
    table = Table(title=title, show_header=True)
    table.add_column("measured window", style="bold")
    table.add_column("value", justify="right")
    for name, value, bad in _invariant_rows(report):
        table.add_row(name, value, style="bold red" if bad else "bold green")
    table.add_section()
    for name, value in _phase_rows(report.measured, protocol):
        style = "red" if name == "mismatched" and report.measured.mismatched else None
        table.add_row(name, value, style=style)
    if report.warmup is not None:
        w = report.warmup
        table.add_row("warmup (excluded)", f"{w.sent:,} sent, {w.ok:,} ok, {w.mismatched:,} mismatched")
    table.add_row("unsent at hard stop", f"{report.scheduled - report.sent:,}")
    table.add_row(
        "generator CPU",
        f"{report.generator_cpu_s:.2f} s ({report.cpu_us_per_request:.0f} us/request)",
    )
    if report.chaos is not None:
        table.add_section()
        for name, value, bad in _chaos_rows(report.chaos):
            table.add_row(name, value, style="red" if bad else None)
    (console or Console()).print(table)
