"""`--model-control poll` against a real `inferd serve`: a model folder removed from the repository is
drained and unloaded (its requests then answer 404 saying so), and served again once put back; a new version folder copied in is served
(a rolling update: the answers come from the new version); a model.toml that stops parsing leaves that
version serving, and the index and the log report it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tritonclient.http as tc_http
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, ServerProc, start_server

SIM = 'builtin = "sim"\nmax_wait_ms = 1\n[params]\nbase_ms = 2.0\n'
WAIT_S = 30.0
"""The most a change may take to be served (a poll every 0.2 s, then a worker's start)."""


def until(what: str, done: Callable[[], bool], server: ServerProc) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}\n{server.log()[-4000:]}")
        time.sleep(0.1)


def infer(client: tc_http.InferenceServerClient, model: str) -> dict:
    inp = tc_http.InferInput("INPUT0", [1], "BYTES")
    inp.set_data_from_numpy(np.array([b"hello"], dtype=object))
    return client.infer(model, [inp]).get_response()


def test_poll_serves_new_versions_keeps_a_broken_folder_serving_and_unloads_removed_models(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    for name in ("sim", "other"):
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(SIM)
    (tmp_path / "inferd.toml").write_text("[server]\nrepository_poll_s = 0.2\n")
    s = start_server(
        tmp_path, "--model-repo", str(repo), "--config", str(tmp_path / "inferd.toml"), "--model-control", "poll"
    )
    client = tc_http.InferenceServerClient(f"127.0.0.1:{s.port}")
    try:
        assert infer(client, "other")["model_version"] == "1"
        shutil.rmtree(repo / "other")

        def unloaded() -> bool:
            try:
                infer(client, "other")
            except InferenceServerException as exc:
                return exc.status() == "404" and "unloaded" in exc.message()
            return False

        until("the removed model answers 404 (unloaded)", unloaded, s)
        until("it leaves the index", lambda: "other" not in {r["name"] for r in client.get_model_repository_index()}, s)
        assert unloaded()
        (repo / "other").mkdir()  # back: served again (an operator's unload would keep it unloaded)
        (repo / "other" / "model.toml").write_text(SIM)

        def answers() -> bool:
            try:
                return infer(client, "other")["model_version"] == "1"
            except InferenceServerException:
                return False

        until("the model folder put back is served again", answers, s)

        assert infer(client, "sim")["model_version"] == "1"
        (repo / "sim" / "2").mkdir()  # a built-in's new version: its folder
        until("version 2 answers", lambda: infer(client, "sim")["model_version"] == "2", s)
        index = client.get_model_repository_index()
        assert [(r["name"], r["version"], r["state"]) for r in index] == [("other", "1", "READY"), ("sim", "2", "READY")]

        (repo / "sim" / "model.toml").write_text("builtin = [not toml\n")

        def sim_row() -> dict:
            (row,) = [r for r in client.get_model_repository_index() if r["name"] == "sim"]
            return row

        def reported() -> bool:
            return "not valid TOML" in sim_row()["reason"]

        until("the broken folder is reported in the index", reported, s)
        assert infer(client, "sim")["model_version"] == "2"  # the old version serves on
        assert "its repository folder does not load" in s.log()
        row = sim_row()
        assert row["state"] == "READY" and row["version"] == "2"
    finally:
        client.close()
        assert s.stop() in (0, -15)


def test_load_model_is_refused_without_explicit(tmp_path: Path) -> None:
    (tmp_path / "m" / "sim").mkdir(parents=True)
    (tmp_path / "m" / "sim" / "model.toml").write_text(SIM)
    args = ["serve", "--model-repo", str(tmp_path / "m"), "--model-control", "poll", "--load-model", "sim"]
    done = subprocess.run([sys.executable, "-m", "inferd.cli.main", *args], cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 2
    assert b"--model-control explicit" in done.stderr
