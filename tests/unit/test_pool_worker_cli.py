"""`inferd worker --pool NAME` and `python -m inferd.worker.main --pool NAME`: one of --model and --pool;
worker/memory.py's measuring of what a load took; the pool worker process's settings (worker/pool.py
`settle_process`)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from inferd.cli.main import app
from inferd.models.sim import SimModel, sim_config
from inferd.worker import memory
from inferd.worker.args import arguments
from inferd.worker.pool import limits


def test_a_worker_serves_one_model_or_a_pool_never_both_nor_neither() -> None:
    assert arguments().parse_args(["--connect", "a:1", "--pool", "p"]).pool == "p"
    assert arguments().parse_args(["--connect", "a:1", "--model", "m"]).pool is None
    for argv in (["--connect", "a:1"], ["--connect", "a:1", "--model", "m", "--pool", "p"]):
        with pytest.raises(SystemExit) as refused:
            arguments().parse_args(argv)
        assert refused.value.code == 2
    env = {"INFERD_JOIN_TOKEN": "t", "COLUMNS": "200"}
    for argv in (["worker", "--connect", "127.0.0.1:9"], ["worker", "--connect", "127.0.0.1:9", "--model", "m", "--pool", "p"]):
        result = CliRunner().invoke(app, argv, env=env)
        assert result.exit_code == 2
        assert "--model NAME (one model) or --pool NAME" in result.output


def test_the_pool_settings_bind_the_worker_from_the_welcome() -> None:
    bound = limits(b'{"workers": 2, "memory_budget_mb": 512.0, "max_loaded_models": 3, "min_resident_s": 1.5}')
    assert (bound.budget_mb, bound.max_loaded_models, bound.max_concurrent_loads, bound.min_resident_s) == (
        512.0, 3, 1, 1.5,
    )
    assert limits(b'{"memory_budget_mb": 64}').max_loaded_models is None


def test_a_sim_model_with_memory_mb_grows_resident_memory_by_that_much_and_unload_gives_it_back() -> None:
    model = SimModel(sim_config("m", params={"memory_mb": 64}))
    before = memory.reading()
    model.load()
    loaded = memory.reading()
    assert before.device_mb is None  # no device here: resident memory is what is measured
    assert before.grown_to(loaded) >= 60.0
    model.unload()
    memory.give_back()
    assert loaded.grown_to(memory.reading()) == 0.0
    assert memory.reading().resident_mb <= loaded.resident_mb - 60.0


PINNED = """
import sys, threading
from inferd.worker import memory
from inferd.worker.pool import settle_process
settle_process()  # a pool worker's start: memory.return_large_frees among its settings
big = bytearray(4 * 2**20)
del big  # an mmapped chunk freed: unpinned, glibc would raise its threshold past 1 MiB
freed = []
def model() -> None:  # a model's buffers, a MiB each, loaded and freed in its device's thread
    buffers = [bytearray(b"\\x01") * 2**20 for _ in range(50)]
    after_them = [object() for _ in range(2000)]  # small allocations made after them (a warm-up)
    loaded = memory.reading()
    buffers.clear()
    freed.append(loaded.resident_mb - memory.reading().resident_mb)
    del after_them
thread = threading.Thread(target=model)
thread.start()
thread.join()
print(freed[0])
"""


def test_a_pool_worker_gives_a_models_large_buffers_back_as_they_are_freed() -> None:
    """With glibc's mmap threshold pinned (`return_large_frees`, by `settle_process` at a pool worker's
    start), 50 MiB of 1 MiB buffers leave resident memory as they are freed, before any trim: the next
    load's growth is its own. (Unpinned, after one large free, the same buffers stay resident: 0.0 MiB freed.) In a process of
    its own: the setting is the whole process's."""
    done = subprocess.run([sys.executable, "-c", PINNED], capture_output=True, text=True, timeout=60, check=True)
    assert float(done.stdout) >= 45.0, done.stdout


def test_a_reading_prefers_the_device_once_there_is_one() -> None:
    cpu = memory.Reading(resident_mb=500.0, device_mb=None)
    assert cpu.grown_to(memory.Reading(resident_mb=600.0, device_mb=None)) == 100.0
    assert cpu.grown_to(memory.Reading(resident_mb=900.0, device_mb=250.0)) == 250.0  # CUDA started in the load
    assert memory.Reading(500.0, 300.0).grown_to(memory.Reading(520.0, 280.0)) == 0.0


def test_device_memory_is_read_from_torch_only_once_it_has_initialized_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: a stand-in for torch's module says what torch.cuda would (the reading never imports
    torch itself, nor starts CUDA)."""

    class Cuda:
        initialized = False

        def is_initialized(self) -> bool:
            return self.initialized

        def memory_allocated(self) -> int:
            return 3 * 2**20

    cuda = Cuda()
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    assert memory.device_mb() is None
    cuda.initialized = True
    assert memory.device_mb() == 3.0
    assert memory.reading().device_mb == 3.0
    monkeypatch.delitem(sys.modules, "torch")
    assert memory.device_mb() is None


def test_a_pool_worker_process_freezes_its_heap_and_shortens_the_gil_switch_interval() -> None:
    """Run in a process of its own: the settings are the whole process's."""
    script = (
        "import gc, sys\n"
        "from inferd.worker.pool import SWITCH_INTERVAL_S, settle_process\n"
        "before = sys.getswitchinterval()\n"
        "settle_process()\n"
        "print(before, sys.getswitchinterval(), SWITCH_INTERVAL_S, gc.get_freeze_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    before, after, wanted, frozen = out.stdout.split()
    assert float(before) == 0.005  # CPython's default
    assert float(after) == pytest.approx(float(wanted)) and float(wanted) < float(before)
    assert int(frozen) > 1000  # the imports left the collector's view


def test_the_pool_worker_entry_point_settles_the_process_before_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    import inferd.worker.main as worker_main

    class Settled(Exception):
        pass

    def settled() -> None:
        raise Settled

    monkeypatch.setattr(worker_main, "settle_process", settled)
    monkeypatch.setattr(worker_main, "set_up_process", lambda *a, **k: None)
    with pytest.raises(Settled):
        worker_main.main(["--connect", "unix:/nonexistent/inferd.sock", "--pool", "p", "--token", "t"])
