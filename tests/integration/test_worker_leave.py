"""A worker leaves a front end gone from its dns: name (worker/discovery.py) by draining from it alone,
against scripted front ends on TCP (127.0.0.2 and 127.0.0.3, one port, as pods behind a headless
Service): it sends that front end Drain, still runs what the front end sent before its answer, delivers
it, then closes that link; the other front end keeps the worker."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from inferd.kinds.llm.sim_llm import VOCAB, SimTokenizer, sim_llm_config, sim_llm_tokens
from inferd.models.sim import sim_config, sim_digest
from inferd.wire import protocol as p
from inferd.worker.main import Worker
from inferd.worker.resolver import Resolver
from tests.conftest import free_port

NAME = "frontends.leave.test"
Front = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def join(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, welcome: p.Welcome) -> None:
    assert isinstance(await p.read_message(reader), p.Hello)
    writer.write(p.encode_frame(welcome))
    assert isinstance(await p.read_message(reader), p.Ready)


async def run_against(worker: Worker, port: int, a: Front, b: Front) -> int:
    servers = [await asyncio.start_server(a, "127.0.0.2", port), await asyncio.start_server(b, "127.0.0.3", port)]
    try:
        return await asyncio.wait_for(worker.run(), 30)
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()


def dns_worker(tmp_path: Path, port: int, model: str) -> tuple[Worker, Path]:
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.2 {NAME}\n127.0.0.3 {NAME}\n")
    resolver = Resolver(hosts, every_s=0.05)
    return Worker(f"dns:{NAME}:{port}", model, "", "w-0", reconnect=True, resolver=resolver), hosts


async def stays(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[str]) -> None:
    """Front end b: keeps the worker with nothing to send (slots it is granted go back at once, as a
    front end with an empty queue gives them back), answering its Drain when the worker drains."""
    try:
        while True:
            msg = await p.read_message(reader)
            seen.append(type(msg).__name__)
            if isinstance(msg, p.Credit) and msg.granted > 0:
                writer.write(p.encode_frame(p.Demand(queued=0, returned=msg.granted)))
            if isinstance(msg, p.Drain):
                writer.write(p.encode_frame(p.Drain()))
    except p.ConnectionClosed:
        pass
    finally:
        writer.close()


async def test_a_worker_leaving_a_front_end_runs_the_batches_it_sent_before_its_answer(tmp_path: Path) -> None:
    config = sim_config(base_ms=50.0, per_item_ms=0.0)
    welcome = p.Welcome(
        accepted=True, model_config_json=config.model_dump_json().encode(), heartbeat_s=1.0, credits=True
    )
    port = free_port()
    worker, hosts = dns_worker(tmp_path, port, "sim")
    done: dict[int, list[object]] = {}
    a_closed = asyncio.Event()
    b_joined = asyncio.Event()
    b_seen: list[str] = []

    async def leaves(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await join(reader, writer, welcome)
        await b_joined.wait()
        writer.write(p.encode_frame(p.Demand(queued=2, oldest_age_s=0.01)))
        while not isinstance(msg := await p.read_message(reader), p.Credit) or msg.granted < 1:
            pass
        writer.write(p.encode_frame(p.RunBatch(1, [b"first"])))
        await writer.drain()
        hosts.write_text(f"127.0.0.3 {NAME}\n")  # a is gone from the name
        drained = False
        try:
            while True:
                msg = await p.read_message(reader)
                if isinstance(msg, p.BatchDone):
                    done[msg.batch_id] = msg.outputs
                if isinstance(msg, p.Drain) and not drained:  # the worker leaves: one more, then answer
                    drained = True
                    writer.write(p.encode_frame(p.RunBatch(2, [b"second"])))
                    writer.write(p.encode_frame(p.Drain()))
        except p.ConnectionClosed:
            a_closed.set()
        finally:
            writer.close()

    async def keeps(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await join(reader, writer, welcome)
        b_joined.set()
        await stays(reader, writer, b_seen)

    async def drain_once_a_is_left() -> None:
        await a_closed.wait()
        assert worker.drain()  # then SIGTERM: b answers, the worker exits

    async with asyncio.TaskGroup() as tg:
        tg.create_task(drain_once_a_is_left())
        code = await run_against(worker, port, leaves, keeps)
    assert code == 0
    assert done == {
        1: [{"OUTPUT0": sim_digest("sim", 1, "first").encode()}],
        2: [{"OUTPUT0": sim_digest("sim", 1, "second").encode()}],
    }
    assert "Drain" in b_seen and "BatchDone" not in b_seen


async def test_an_llm_worker_leaving_a_front_end_finishes_its_sequences_there_first(tmp_path: Path) -> None:
    config = sim_llm_config(params={"step_base_ms": 2.0})
    tok = SimTokenizer()
    welcome = p.Welcome(
        accepted=True, model_config_json=config.model_dump_json().encode(), heartbeat_s=0.05, credits=True
    )
    port = free_port()
    worker, hosts = dns_worker(tmp_path, port, "sim-llm")
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    a_closed = asyncio.Event()
    b_joined = asyncio.Event()
    b_seen: list[str] = []

    async def leaves(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await join(reader, writer, welcome)
        await b_joined.wait()
        writer.write(p.encode_frame(p.AddSequence("early", tok.encode("running when left"), 30, seed=1)))
        drained = False
        try:
            while True:
                msg = await p.read_message(reader)
                if isinstance(msg, p.StepDeltas):
                    for d in msg.all_deltas():
                        tokens.setdefault(d.seq_id, []).extend(d.token_ids)
                        if d.finish_reason:
                            finish[d.seq_id] = d.finish_reason
                    if "early" in tokens and hosts.read_text().count(NAME) == 2:
                        hosts.write_text(f"127.0.0.3 {NAME}\n")  # a is gone from the name, mid-sequence
                if isinstance(msg, p.Drain) and not drained:
                    drained = True
                    late = p.AddSequence("late", tok.encode("sent before the answer"), 20, seed=2)
                    writer.write(p.encode_frame(late))
                    writer.write(p.encode_frame(p.Drain()))
        except p.ConnectionClosed:
            a_closed.set()
        finally:
            writer.close()

    async def keeps(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await join(reader, writer, welcome)
        b_joined.set()
        await stays(reader, writer, b_seen)

    async def drain_once_a_is_left() -> None:
        await a_closed.wait()
        assert worker.drain()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(drain_once_a_is_left())
        code = await run_against(worker, port, leaves, keeps)
    assert code == 0
    assert finish == {"early": "length", "late": "length"}
    assert [VOCAB[t] for t in tokens["early"]] == sim_llm_tokens("running when left", 1, 30)
    assert [VOCAB[t] for t in tokens["late"]] == sim_llm_tokens("sent before the answer", 2, 20)
