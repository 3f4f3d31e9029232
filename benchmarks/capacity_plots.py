"""The plots of docs/capacity.md: latency against load, simulated against real, for `sim` (a batch
model, fleetsim/batch_fleet.py) and `sim-llm` (fleetsim/llm_fleet.py), and the bundled published H100 /
Llama-3-8B profile's TTFT and ITL against per-device load (simulated only).

Needs matplotlib, which is not an inferd dependency: `pip install matplotlib`. Runs real servers on
127.0.0.1 (about 5 minutes on a quiet 2-core machine):

    .venv/bin/python benchmarks/capacity_plots.py [--out docs] [--duration 12]

Writes OUT/capacity_sim.png, OUT/capacity_sim_llm.png, OUT/capacity_h100_llama3_8b.png and
OUT/capacity_plots.json (every number plotted).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from inferd.fleetsim.llm_plan import LLMTargets, simulate_slice
from inferd.fleetsim.llm_profile import bundled
from inferd.fleetsim.validate import Case, run_case
from inferd.fleetsim.validate_llm import LLMCase, run_llm_case

LOADS = (0.3, 0.5, 0.7, 0.8, 0.9)


def batch_points(duration: float, tmp: Path) -> list[dict]:
    case = Case("sim 2 workers", 2, 100.0, 1.0, loads=LOADS)
    return [asdict(r) for r in run_case(case, duration, 2.0, tmp)]


def llm_points(duration: float, tmp: Path) -> list[dict]:
    out = []
    for result, real, sim in run_llm_case(replace(LLMCase(), loads=LOADS), duration, 2.0, tmp):
        out.append(
            {
                **asdict(result),
                "real_ttft_p99_ms": real.ttft_ms["p99"],
                "sim_ttft_p99_ms": sim.ttft_p99_ms,
                "real_itl_p99_ms": real.itl_ms["p99"],
                "sim_itl_p99_ms": sim.itl_p99_ms,
            }
        )
    return out


def h100_points() -> list[dict]:
    profile = bundled()
    t = LLMTargets(1.0, 500, 200, 1000.0, 100.0)
    out = []
    for rate in (5.0, 10.0, 15.0, 20.0, 24.0, 26.0, 28.0, 30.0):
        sim = simulate_slice(profile, t, rate, devices=4, duration_s=40.0)
        out.append({"rate_per_device": rate, **sim.to_dict()})
    return out


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    b = data["sim"]
    ax.plot([p["load"] for p in b], [p["real_p99_ms"] for p in b], "o-", label="real p99")
    ax.plot([p["load"] for p in b], [p["sim_p99_ms"] for p in b], "s--", label="simulated p99")
    ax.set(xlabel="load (fraction of fitted capacity)", ylabel="latency p99 (ms)",
           title="sim (batch model), 2 workers: real vs simulated")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "capacity_sim.png", dpi=110)

    fig, ax = plt.subplots(figsize=(6, 4))
    m = data["sim_llm"]
    loads = [p["load"] for p in m]
    ax.plot(loads, [p["real_p99_ms"] for p in m], "o-", label="real e2e p99")
    ax.plot(loads, [p["sim_p99_ms"] for p in m], "s--", label="simulated e2e p99")
    ax.plot(loads, [p["real_ttft_p99_ms"] for p in m], "^-", label="real TTFT p99")
    ax.plot(loads, [p["sim_ttft_p99_ms"] for p in m], "v--", label="simulated TTFT p99")
    ax.set(xlabel="load (fraction of fitted capacity)", ylabel="ms", yscale="log",
           title="sim-llm, 2 workers: real vs simulated")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "capacity_sim_llm.png", dpi=110)

    fig, ax = plt.subplots(figsize=(6, 4))
    h = data["h100"]
    rates = [p["rate_per_device"] for p in h]
    ax.plot(rates, [p["ttft_p99_ms"] for p in h], "o-", label="TTFT p99")
    ax.plot(rates, [p["itl_p99_ms"] for p in h], "s-", label="ITL p99")
    ax.plot(rates, [p["itl_p50_ms"] for p in h], "s:", label="ITL p50")
    ax.axhline(100, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="requests/s per device (500 prompt + 200 output tokens)", ylabel="ms", yscale="log",
           title="H100 / Llama-3-8B (published profile), simulated")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "capacity_h100_llama3_8b.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--duration", type=float, default=12.0)
    parser.add_argument("--only", choices=("sim", "sim_llm", "h100"), action="append")
    args = parser.parse_args()
    path = args.out / "capacity_plots.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    with tempfile.TemporaryDirectory(prefix="inferd-capacity-") as tmp:
        parts = args.only or ["sim", "sim_llm", "h100"]
        for part, run in (
            ("sim", lambda: batch_points(args.duration, Path(tmp))),
            ("sim_llm", lambda: llm_points(args.duration, Path(tmp))),
            ("h100", h100_points),
        ):
            if part in parts:
                data[part] = run()
                print(f"{part}: {json.dumps(data[part], default=str)}", flush=True)
                path.write_text(json.dumps(data, indent=1, default=str))
    plot(data, args.out)


if __name__ == "__main__":
    main()
