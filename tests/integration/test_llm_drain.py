"""An LLM worker told to drain, against a scripted front end on a Unix socket: it finishes the
sequences it holds, still takes aborts sent after the Drain (a client that left during the drain), and
then ends its session on its own (exit code 0, so its supervisor replaces it without counting a crash)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from inferd.kinds.llm.sim_llm import VOCAB, SimTokenizer, sim_llm_config, sim_llm_tokens
from inferd.wire import protocol as p
from inferd.worker.main import Worker


async def test_a_draining_llm_worker_finishes_its_sequences_takes_aborts_and_exits(tmp_path: Path) -> None:
    config = sim_llm_config(params={"step_base_ms": 2.0})
    tok = SimTokenizer()
    steps: list[p.StepDeltas] = []
    closed = asyncio.Event()

    async def front(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert isinstance(await p.read_message(reader), p.Hello)
        welcome = p.Welcome(
            accepted=True, model_config_json=config.model_dump_json().encode(), heartbeat_s=1.0
        )
        writer.write(p.encode_frame(welcome))
        assert isinstance(await p.read_message(reader), p.Ready)
        for msg in (
            p.AddSequence("keep", tok.encode("finish me please"), 40, seed=1),
            p.AddSequence("drop", tok.encode("abort me later"), 1000, seed=2),
            p.Drain(),
            p.AbortSequence("drop"),  # its client left after the drain began
        ):
            writer.write(p.encode_frame(msg))
        await writer.drain()
        try:
            while True:
                msg = await p.read_message(reader)
                if isinstance(msg, p.StepDeltas):
                    steps.append(msg)
        except p.ConnectionClosed:
            closed.set()
        finally:
            writer.close()

    path = tmp_path / "front.sock"
    server = await asyncio.start_unix_server(front, path=str(path))
    try:
        code = await asyncio.wait_for(Worker(f"unix:{path}", "sim-llm", "", "w-0").run(), 60)
        await asyncio.wait_for(closed.wait(), 10)
    finally:
        server.close()
        await server.wait_closed()
    assert code == 0  # drained
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for step in steps:
        for d in step.all_deltas():
            tokens.setdefault(d.seq_id, []).extend(d.token_ids)
            if d.finish_reason:
                finish[d.seq_id] = d.finish_reason
    assert [VOCAB[t] for t in tokens["keep"]] == sim_llm_tokens("finish me please", 1, 40)
    assert finish == {"keep": "length", "drop": "abort"}
    assert len(tokens.get("drop", [])) < 1000
    assert steps[-1].stats.running == 0 and steps[-1].stats.kv_blocks_used == 0
