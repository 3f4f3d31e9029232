"""Loaded by benchmarks/request_walk.py's servers (this folder first on PYTHONPATH): between SIGUSR1 and
SIGUSR2, records the inferd and uvicorn modules whose functions run, in first-call order, and the
Python calls made by package; written to $INFERD_WALK_OUT.PID at SIGUSR2. Inert without that variable."""

import collections
import json
import os
import signal
import sys
import threading

_OUT = os.environ.get("INFERD_WALK_OUT")
if _OUT:
    _seen: dict[str, str] = {}
    _calls: collections.Counter[str] = collections.Counter()

    def _profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            module = frame.f_globals.get("__name__", "") or "?"
            _calls[module if module.startswith("inferd") else module.split(".")[0]] += 1
            if module.startswith(("inferd", "uvicorn")) and module not in _seen:
                _seen[module] = frame.f_code.co_name

    def _start(signum, frame):  # type: ignore[no-untyped-def]
        _seen.clear()
        _calls.clear()
        sys.setprofile(_profile)
        threading.setprofile(_profile)

    def _stop(signum, frame):  # type: ignore[no-untyped-def]
        sys.setprofile(None)
        threading.setprofile(None)
        with open(f"{_OUT}.{os.getpid()}", "w") as f:
            json.dump({"modules": list(_seen.items()), "calls": dict(_calls)}, f)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
