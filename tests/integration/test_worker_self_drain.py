"""A worker that drains itself (what SIGTERM does: Worker.drain), against a scripted front end on a Unix
socket: it tells the front end (Drain), still takes the work the front end sent before its answer (a
Drain back), finishes all of it, delivers it and exits 0."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from inferd.kinds.llm.sim_llm import VOCAB, SimTokenizer, sim_llm_config, sim_llm_tokens
from inferd.models.sim import sim_config, sim_digest
from inferd.wire import protocol as p
from inferd.worker.main import Worker

Front = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def run_against(worker: Worker, path: Path, front: Front) -> int:
    """The worker's exit code, serving the scripted front end listening on `path`."""
    server = await asyncio.start_unix_server(front, path=str(path))
    try:
        return await asyncio.wait_for(worker.run(), 30)
    finally:
        server.close()
        await server.wait_closed()


async def join(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, welcome: p.Welcome) -> None:
    assert isinstance(await p.read_message(reader), p.Hello)
    writer.write(p.encode_frame(welcome))
    assert isinstance(await p.read_message(reader), p.Ready)


async def test_a_worker_draining_itself_runs_the_batches_sent_before_the_front_end_answered(
    tmp_path: Path,
) -> None:
    config = sim_config(base_ms=50.0, per_item_ms=0.0)
    welcome = p.Welcome(
        accepted=True, model_config_json=config.model_dump_json().encode(), heartbeat_s=1.0, credits=True
    )
    path = tmp_path / "front.sock"
    worker = Worker(f"unix:{path}", "sim", "", "w-0")
    done: dict[int, list[object]] = {}
    seen: list[str] = []

    async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await join(reader, writer, welcome)
        while not isinstance(msg := await p.read_message(reader), p.Credit) or msg.granted < 2:
            pass
        writer.write(p.encode_frame(p.RunBatch(1, [b"first"])))
        await writer.drain()
        assert worker.drain()  # SIGTERM
        try:
            while True:
                msg = await p.read_message(reader)
                seen.append(type(msg).__name__)
                if isinstance(msg, p.BatchDone):
                    done[msg.batch_id] = msg.outputs
                if isinstance(msg, p.Drain) and seen.count("Drain") == 1:
                    # in flight when the worker's Drain came: sent against the second slot, then the answer
                    writer.write(p.encode_frame(p.RunBatch(2, [b"second"])))
                    writer.write(p.encode_frame(p.Drain()))
        except p.ConnectionClosed:
            pass
        finally:
            writer.close()

    code = await run_against(worker, path, front)
    assert code == 0
    assert "Drain" in seen and "Credit" not in seen[seen.index("Drain") :]  # no new slot once draining
    assert done == {
        1: [{"OUTPUT0": sim_digest("sim", 1, "first").encode()}],
        2: [{"OUTPUT0": sim_digest("sim", 1, "second").encode()}],
    }


async def test_an_llm_worker_draining_itself_finishes_the_sequences_sent_before_the_answer(
    tmp_path: Path,
) -> None:
    config = sim_llm_config(params={"step_base_ms": 2.0})
    tok = SimTokenizer()
    welcome = p.Welcome(accepted=True, model_config_json=config.model_dump_json().encode(), heartbeat_s=1.0)
    path = tmp_path / "front.sock"
    worker = Worker(f"unix:{path}", "sim-llm", "", "w-0")
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}

    async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await join(reader, writer, welcome)
        writer.write(p.encode_frame(p.AddSequence("early", tok.encode("running when told"), 30, seed=1)))
        answered = False
        try:
            while True:
                msg = await p.read_message(reader)
                if isinstance(msg, p.StepDeltas):
                    for d in msg.all_deltas():
                        tokens.setdefault(d.seq_id, []).extend(d.token_ids)
                        if d.finish_reason:
                            finish[d.seq_id] = d.finish_reason
                    if "early" in tokens and not answered and worker.drain():  # SIGTERM, mid-sequence
                        answered = True
                if isinstance(msg, p.Drain):
                    late = p.AddSequence("late", tok.encode("sent before the answer"), 20, seed=2)
                    writer.write(p.encode_frame(late))
                    writer.write(p.encode_frame(p.Drain()))
        except p.ConnectionClosed:
            pass
        finally:
            writer.close()

    code = await run_against(worker, path, front)
    assert code == 0
    assert finish == {"early": "length", "late": "length"}
    assert [VOCAB[t] for t in tokens["early"]] == sim_llm_tokens("running when told", 1, 30)
    assert [VOCAB[t] for t in tokens["late"]] == sim_llm_tokens("sent before the answer", 2, 20)
