"""The warm-up gate, kind by kind, in process: a worker's model runs its warm-up before the worker tells the
front end Ready (batch: `warmup_inputs`; LLM: a short prefill and decode, kinds/llm/warmup.py), and a
search replica runs a query before it answers its assignment (kinds/search/warmup.py). sim's and sim-llm's
`params.warmup_ms` make that first call slow, once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from inferd.config import ModelConfig
from inferd.kinds.llm import warmup as llm_warmup
from inferd.kinds.llm.model import LLMModel, LLMRequest
from inferd.kinds.llm.plan import SeqOutput, StepPlan
from inferd.kinds.llm.sim_llm import SimLLM, sim_llm_config
from inferd.kinds.search import replica as replica_module
from inferd.kinds.search import wire
from inferd.kinds.search.config import SearchParams
from inferd.kinds.search.replica import Replica
from inferd.kinds.search.shard import ShardIndex
from inferd.kinds.search.types import Document, LogEntry, Upsert
from inferd.kinds.search.warmup import HOOK, warm_up
from inferd.models.base import Model
from inferd.models.sim import SimModel, sim_config
from inferd.wire import protocol as p
from inferd.worker.device import Device

# ---- the first call's cost: sim and sim-llm's params.warmup_ms ---------------------------------------------


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """What the simulated devices ask time.sleep for (they sleep nothing here)."""
    asked: list[float] = []
    monkeypatch.setattr("time.sleep", asked.append)
    return asked


def test_sim_warmup_ms_is_the_first_calls_cost_once(sleeps: list[float]) -> None:
    model = SimModel(sim_config(base_ms=1.0, params={"warmup_ms": 5000.0}))
    model.load()
    assert model.predict_batch(model.warmup_inputs()) == model.predict_batch(model.warmup_inputs())
    first, second = sleeps[-2:]
    assert first > 5.0 and second < 1.0


def test_sim_llm_warmup_ms_is_the_first_steps_cost_once(sleeps: list[float]) -> None:
    model = SimLLM(sim_llm_config(params={"warmup_ms": 5000.0}))
    model.load()
    llm_warmup.warm_up(model)
    steps = [s for s in sleeps if s > 0]
    assert len(steps) == 1 + llm_warmup.DECODE_STEPS
    assert steps[0] > 5.0 and max(steps[1:]) < 1.0


# ---- the LLM warm-up: a prefill, then decodes of the sampled tokens, then the sequence released -------------


class Recorder(LLMModel):
    """Answers token 7 for every sampling chunk (or none, with `fail`); records each plan and release."""

    def __init__(self, params: dict[str, Any] | None = None, fail: bool = False) -> None:
        super().__init__(sim_llm_config(params=params or {}))
        self.fail = fail
        self.events: list[Any] = []

    def run_step(self, plan: StepPlan, requests: Mapping[str, LLMRequest]) -> dict[str, SeqOutput]:
        self.events.append(plan)
        if self.fail:
            return {c.seq_id: SeqOutput(finish=None) for c in plan.chunks}
        return {c.seq_id: SeqOutput(token=7) for c in plan.chunks if c.samples}

    def release(self, seq_id: str) -> None:
        self.events.append(("release", seq_id))


def test_the_llm_warm_up_prefills_then_decodes_the_sampled_tokens_and_releases() -> None:
    model = Recorder()
    llm_warmup.warm_up(model)
    *plans, released = model.events
    assert released == ("release", llm_warmup.WARMUP_SEQ)
    chunks = [plan.chunks[0] for plan in plans]
    assert [len(plan.chunks) for plan in plans] == [1, 1, 1]
    assert chunks[0].start == 0 and len(chunks[0].token_ids) == llm_warmup.PROMPT_TOKENS and chunks[0].samples
    assert [(c.start, c.token_ids) for c in chunks[1:]] == [(8, (7,)), (9, (7,))]  # each decodes the last token
    assert all(c.samples for c in chunks)


def test_the_llm_warm_ups_prompt_fits_the_step_budget() -> None:
    model = Recorder({"scheduler": {"max_num_batched_tokens": 4, "max_num_seqs": 2}})
    llm_warmup.warm_up(model)
    assert model.events[0].chunks[0].token_ids == (1, 2, 3, 4)


def test_an_llm_warm_up_that_samples_nothing_fails_and_still_releases() -> None:
    model = Recorder(fail=True)
    with pytest.raises(RuntimeError, match="sampled no token"):
        llm_warmup.warm_up(model)
    assert model.events[-1] == ("release", llm_warmup.WARMUP_SEQ)


# ---- the worker: Ready only after the warm-up --------------------------------------------------------------


class FakeLink:
    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def send(self, msg: p.Message) -> None:
        self.events.append(msg)

    async def flush(self) -> None:
        return None


EVENTS: list[Any] = []
"""What the models below did, and what the worker sent (FakeLink), in order."""


class EventSim(SimModel):
    def predict_batch(self, inputs: list[bytes]) -> list[str]:
        EVENTS.append(("predict", inputs))
        return super().predict_batch(inputs)


class EventSimLLM(SimLLM):
    def run_step(self, plan: StepPlan, requests: Mapping[str, LLMRequest]) -> dict[str, SeqOutput]:
        EVENTS.append(("step", plan.step))
        return super().run_step(plan, requests)


def recording(config: ModelConfig, cls: str) -> ModelConfig:
    return config.model_copy(update={"implementation": f"tests.unit.test_warmup_gate:{cls}"})


@pytest.mark.parametrize(
    ("config", "warm_up"),
    [
        (recording(sim_config(base_ms=1.0), "EventSim"), [("predict", [b"warmup"])]),
        (recording(sim_llm_config(params={"step_base_ms": 1.0}), "EventSimLLM"), [("step", s) for s in range(3)]),
    ],
    ids=["batch", "llm"],
)
async def test_the_worker_says_ready_only_after_its_models_warm_up(config: Any, warm_up: list[Any]) -> None:
    EVENTS.clear()
    device = Device("w", None)
    try:
        model = await device._load(FakeLink(EVENTS), config)  # type: ignore[arg-type]
    finally:
        device.executor.shutdown()
    assert isinstance(model, Model)
    assert EVENTS[:-1] == warm_up
    assert isinstance(EVENTS[-1], p.Ready) and EVENTS[-1].warmup_s > 0


async def test_a_failed_llm_warm_up_is_a_failed_load_not_a_ready_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_token(self: SimLLM, plan: StepPlan, requests: Mapping[str, LLMRequest]) -> dict[str, SeqOutput]:
        return {}

    monkeypatch.setattr(SimLLM, "run_step", no_token)
    sent: list[Any] = []
    device = Device("w", None)
    try:
        assert await device._load(FakeLink(sent), sim_llm_config()) is None  # type: ignore[arg-type]
    finally:
        device.executor.shutdown()
    assert [type(m) for m in sent] == [p.LoadFailed] and "sampled no token" in sent[0].message


# ---- the search replica: a query before it answers its assignment ------------------------------------------


def test_the_search_warm_up_queries_the_index_and_honours_the_test_hook(
    monkeypatch: pytest.MonkeyPatch, sleeps: list[float]
) -> None:
    index = ShardIndex(SearchParams(embedder="none").settings())
    index.apply(LogEntry(seq=1, ops=[Upsert(doc=Document(id="a", text="the index warms up"))]))
    queries = []
    real = ShardIndex.search
    monkeypatch.setattr(ShardIndex, "search", lambda self, q: queries.append(q) or real(self, q))
    monkeypatch.setenv(HOOK, "3000")
    warm_up(index)
    assert len(queries) == 1 and queries[0].text and queries[0].vector is not None
    assert sleeps and sleeps[-1] > 2.5


def test_the_replica_answers_its_assignment_after_the_warm_up_and_tells_no_one_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    replica = Replica("w")
    seen = []

    def warming(index: ShardIndex) -> float:
        seen.append((replica.index, wire.number(replica._note().body)))  # what a link joining now is told
        return 0.0

    monkeypatch.setattr(replica_module, "warm_up", warming)
    settings = wire.encode(SearchParams(embedder="none").settings())
    reply = replica._assign(p.ShardAssign(0, settings))
    assert seen == [(None, -1)]  # while it warms up: no index to read, the shard not announced
    assert reply.error is None and replica.index is not None and wire.number(replica._note().body) == 0
