"""CPU of the worker's credit decisions (worker/credits.py CreditLedger.to_tell) against the number of
front ends a worker serves: every front end has joined and reported demand, and each call tells them all.

    .venv/bin/python benchmarks/credit_ledger.py [--fronts 3,16,64,256] [--calls 200]
"""

from __future__ import annotations

import argparse
import time

from inferd.clock import FakeClock
from inferd.worker.credits import CreditLedger


def per_call_us(fronts: int, calls: int) -> float:
    ledger = CreditLedger(FakeClock())
    for f in range(fronts):
        ledger.join(f)
    for f in range(fronts):
        ledger.report(f, 10, 0.1)
    told = dict.fromkeys(range(fronts))
    started = time.perf_counter()
    for _ in range(calls):
        ledger.to_tell(told)
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fronts", default="3,16,64,256")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    for fronts in (int(n) for n in args.fronts.split(",")):
        print(f"{fronts:>5} front ends: {per_call_us(fronts, args.calls):8.1f} us per to_tell")


if __name__ == "__main__":
    main()
