"""The walk of one request through the server, module by module: which inferd (and uvicorn) modules run,
in the order first called, in the front end and in the worker, and how many Python calls each package
made. One OIP infer on `sim` and one streamed chat on `sim-llm`, each alone on an idle server.

    .venv/bin/python benchmarks/request_walk.py [--tree DIR]   (DIR: another checkout, e.g. an older commit)

Each server process loads benchmarks/walk_hook/sitecustomize.py, which records between SIGUSR1 and
SIGUSR2. Background loops (watchdogs, the console's sampling, uvicorn's tick) that run inside the window
are left out by name; prometheus_client's calls are the console's sampling, not the request's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from harness import ROOT, free_port, http_ok
from procfs import process_tree

HOOK = ROOT / "benchmarks" / "walk_hook"
BACKGROUND = ("watchdog", "placement", "runtime.run", "_supervised", "on_tick", "main_loop", "console_feed")
OIP = b'{"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}'
CHAT = b'{"model": "sim-llm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": true}'


def one_walk(tree: Path, path: str, body: bytes) -> list[dict]:
    port = free_port()
    out = Path(tempfile.mkdtemp(prefix="walk.")) / "walk"
    env = {**os.environ, "INFERD_WALK_OUT": str(out), "PYTHONPATH": f"{HOOK}:{tree / 'src'}"}
    cmd = [sys.executable, "-m", "inferd.cli.main", "serve", "--model", "sim", "--model", "sim-llm",
           "--port", str(port), "--no-admin", "--log-level", "WARNING"]  # fmt: skip
    if (tree / "src" / "inferd" / "grpc_edge").is_dir():  # a tree with the gRPC API: the walk is HTTP's
        cmd.append("--no-grpc")
    server = subprocess.Popen(cmd, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not http_ok(f"http://127.0.0.1:{port}/v2/health/ready"):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not get ready")
            time.sleep(0.3)
        time.sleep(2.0)  # start-up settles: workers warm, first scrapes done
        pids = sorted(process_tree(server.pid))
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.05)
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as resp:
            resp.read()
        time.sleep(0.1)
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        time.sleep(0.3)
        walks = []
        for pid in pids:
            f = Path(f"{out}.{pid}")
            if f.exists():
                data = json.loads(f.read_text())
                mods = [(m, fn) for m, fn in data["modules"] if not any(b in f"{m}.{fn}" for b in BACKGROUND)]
                if mods:
                    walks.append({"pid": pid, "front_end": pid == server.pid, "modules": mods,
                                  "calls": data["calls"]})  # fmt: skip
        return walks
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=ROOT)
    args = ap.parse_args()
    for name, path, body in (("OIP infer", "/v2/models/sim/infer", OIP), ("streamed chat", "/v1/chat/completions", CHAT)):
        print(f"## {name} ({args.tree})")
        for walk in one_walk(args.tree.resolve(), path, body):
            inferd = [m for m, _ in walk["modules"] if m.startswith("inferd")]
            uvicorn = [m for m, _ in walk["modules"] if m.startswith("uvicorn")]
            folders = sorted({".".join(m.split(".")[:2]) for m in inferd})
            calls = {k: v for k, v in walk["calls"].items() if k != "prometheus_client"}
            where = "front end" if walk["front_end"] else "worker"
            print(f"- {where}: {len(inferd)} inferd modules in {len(folders)} folders, {len(uvicorn)} uvicorn "
                  f"modules, {sum(calls.values())} Python calls (prometheus_client's left out)")
            print("  " + " -> ".join(m.removeprefix("inferd.") for m, _ in walk["modules"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
