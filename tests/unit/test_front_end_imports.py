"""The front end never loads a kind's device-side libraries: faiss (search replicas), onnxruntime (the
minilm embedder) and llama_cpp (the llama.cpp engine) are imported by worker processes only. Each check
imports the modules in a fresh interpreter, so nothing an earlier test imported counts."""

from __future__ import annotations

import json
import subprocess
import sys

DEVICE_LIBRARIES = ("faiss", "onnxruntime", "llama_cpp")

FRONT_END_PACKAGES = ("inferd.api", "inferd.core", "inferd.gateway", "inferd.frontends", "inferd.fleet")
FRONT_END_MODULES = (
    "inferd.server",
    "inferd.runner",
    "inferd.runner.parent",
    "inferd.cli.main",
    "inferd.kinds.builtin",
    "inferd.kinds.repository",
    "inferd.kinds.collectors",
)

PROBE = """
import importlib, json, pkgutil, sys
packages, modules, libraries = json.loads(sys.argv[1])
names = list(modules)
for package in packages:
    names.append(package)
    names.extend(m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."))
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": len(names), "loaded": [lib for lib in libraries if lib in sys.modules]}))
"""


def loaded_after_importing(packages: tuple[str, ...], modules: tuple[str, ...]) -> dict[str, object]:
    args = json.dumps([packages, modules, DEVICE_LIBRARIES])
    out = subprocess.run([sys.executable, "-c", PROBE, args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_the_probe_sees_a_device_library_load() -> None:
    found = loaded_after_importing((), ("inferd.kinds.search.dense",))  # the dense index imports faiss
    assert found["loaded"] == ["faiss"]


def test_front_end_modules_load_no_device_library() -> None:
    found = loaded_after_importing(FRONT_END_PACKAGES, FRONT_END_MODULES)
    assert found["loaded"] == [], (
        f"the front end imports {found['loaded']}: a kind's worker side leaked into it"
    )
