"""sim-llm through the real server and its worker process, with the `openai` client: completions and
chat, streaming and not; each stream is checked against sim_llm_tokens for its own request. Also:
chat's default length (the rest of the context), and deadlines (504 or an error event, the sequence
aborted in the engine and its KV blocks freed; none by default)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from inferd.kinds.llm.sim_llm import sim_llm_chat_prompt, sim_llm_tokens
from tests.conftest import ServerProc, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("llm")
    repo = root / "repo"
    models = {
        "sim": 'builtin = "sim"\n',
        # default_timeout_ms must not cut text generation short: it has no default deadline
        "sim-llm": 'builtin = "sim-llm"\ndefault_timeout_ms = 200\n',
        "short": 'builtin = "sim-llm"\n[params]\nmax_model_len = 64\nstep_base_ms = 1.0\n',
    }
    for name, toml in models.items():
        (repo / name).mkdir(parents=True)
        (repo / name / "model.toml").write_text(toml)
    s = start_server(root, "--model-repo", str(repo))
    yield s
    assert s.stop() in (0, -15)


def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def expected(prompt: str, seed: int | None, n: int) -> str:
    return " ".join(sim_llm_tokens(prompt, seed, n))


async def ametric(server: ServerProc, name: str, absent: float | None = None) -> float:
    """A sample's value; `absent` when the series does not exist yet (else that fails the test)."""
    async with aiohttp.ClientSession() as http, http.get(f"{server.url}/metrics") as r:
        text = await r.text()
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    if found is None and absent is not None:
        return absent
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_models_lists_llm_and_batch_models(server: ServerProc) -> None:
    ids = {m.id for m in client(server).models.list()}
    assert {"sim", "sim-llm"} <= ids


async def test_llm_metadata_says_its_kind_and_oip_infer_names_the_openai_routes(server: ServerProc) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/v2/models/sim-llm") as r:
            meta = await r.json()
        assert meta == {"name": "sim-llm", "versions": ["1"], "platform": "inferd_llm", "kind": "llm"}
        body = {"inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
        async with http.post(f"{server.url}/v2/models/sim-llm/infer", json=body) as r:
            assert r.status == 400
            assert "/v1/chat/completions" in (await r.json())["error"]
        async with http.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": "x"}) as r:
            assert r.status == 404
            message = (await r.json())["error"]["message"]
        assert "'sim'" in message and "'sim-llm'" in message  # every model, whatever its kind
        async with http.post(f"{server.url}/v1/completions", json={"model": "sim", "prompt": "x"}) as r:
            assert r.status == 400
            assert "batch model" in (await r.json())["error"]["message"]
        async with http.post(
            f"{server.url}/v1/completions", json={"model": "sim-llm", "prompt": "a b", "max_tokens": 2}
        ) as r:
            assert r.status == 200 and r.headers["X-Inferd-Model-Version"] == "1"


def test_completion_text_is_the_documented_tokens(server: ServerProc) -> None:
    out = client(server).completions.create(
        model="sim-llm", prompt="the quick brown fox", max_tokens=12, seed=7
    )
    assert out.object == "text_completion"
    assert out.choices[0].text == expected("the quick brown fox", 7, 12)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (4, 12, 16)


def test_streamed_completion_with_usage(server: ServerProc) -> None:
    chunks = list(
        client(server).completions.create(
            model="sim-llm",
            prompt="stream me",
            max_tokens=20,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected("stream me", 3, 20)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_non_stream_and_stream(server: ServerProc) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    prompt = sim_llm_chat_prompt(messages)
    c = client(server)
    out = c.chat.completions.create(model="sim-llm", messages=messages, max_tokens=9, seed=11)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected(prompt, 11, 9)
    chunks = list(
        c.chat.completions.create(
            model="sim-llm", messages=messages, max_completion_tokens=9, seed=11, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected(prompt, 11, 9)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_stream_and_not(server: ServerProc) -> None:
    """n=3: choice i samples with seed + i; usage counts every choice's tokens."""
    c = client(server)
    out = c.completions.create(model="sim-llm", prompt="pick three", max_tokens=5, seed=10, n=3)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.text for ch in out.choices] == [expected("pick three", 10 + i, 5) for i in range(3)]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (2, 15)
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    chunks = c.chat.completions.create(
        model="sim-llm",
        messages=[{"role": "user", "content": "three ways"}],
        max_tokens=4,
        seed=3,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    prompt = sim_llm_chat_prompt([{"role": "user", "content": "three ways"}])
    assert texts == {i: expected(prompt, 3 + i, 4) for i in range(3)}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError, match="n must be between 1 and 16"):
        c.completions.create(model="sim-llm", prompt="too many", max_tokens=2, n=17)


def test_stop_string_cuts_the_text(server: ServerProc) -> None:
    words = sim_llm_tokens("stop here", 5, 40)
    stop_word = words[6]
    full = " ".join(words)
    cut = full[: full.index(" " + stop_word + " ")]
    out = client(server).completions.create(
        model="sim-llm", prompt="stop here", max_tokens=40, seed=5, stop=[" " + stop_word + " "]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == cut


async def test_concurrent_streams_each_get_their_own_tokens(server: ServerProc) -> None:
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:

        async def one(i: int) -> tuple[int, str]:
            stream = await c.completions.create(
                model="sim-llm", prompt=f"caller {i} says hi", max_tokens=8 + i % 5, seed=i, stream=True
            )
            return i, "".join([ch.choices[0].text async for ch in stream if ch.choices])

        results = await asyncio.gather(*(one(i) for i in range(40)))
    for i, text in results:
        assert text == expected(f"caller {i} says hi", i, 8 + i % 5)


def test_prompt_too_long_is_an_openai_400(server: ServerProc) -> None:
    prompt = " ".join(["word"] * 2040)
    with pytest.raises(openai.BadRequestError) as info:
        client(server).completions.create(model="sim-llm", prompt=prompt, max_tokens=100)
    body = info.value.body
    assert body["code"] == "context_length_exceeded"
    assert body["message"].startswith(
        "This model's maximum context length is 2048 tokens. However, you requested 2140 tokens"
    )


def test_unknown_and_non_llm_models(server: ServerProc) -> None:
    with pytest.raises(openai.NotFoundError):
        client(server).completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(model="sim", prompt="x")


async def test_disconnect_mid_stream_aborts_the_sequence(server: ServerProc) -> None:
    aborted_key = 'inferd_llm_sequences_ended_total{model="sim-llm",outcome="aborted",version="1"}'
    gone_key = 'inferd_llm_client_aborts_total{model="sim-llm",version="1"}'
    aborted_before = await ametric(server, aborted_key)
    gone_before = await ametric(server, gone_key)
    body = {"model": "sim-llm", "prompt": "a long story", "max_tokens": 1500, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = 0
            async for line in r.content:
                events += line.startswith(b"data: ")
                if events == 3:
                    break
        # leaving the block closes the connection mid-stream
    aborted = aborted_before
    for _ in range(100):
        aborted = await ametric(server, aborted_key)
        if aborted > aborted_before:
            break
        await asyncio.sleep(0.05)
    assert aborted == aborted_before + 1, "the engine never aborted the sequence of the client that left"
    assert await ametric(server, gone_key) == gone_before + 1
    assert await ametric(server, 'inferd_llm_sequences{model="sim-llm",state="running",version="1"}') == 0
    assert await ametric(server, 'inferd_llm_streams{model="sim-llm",version="1"}') == 0


async def test_disconnect_while_a_whole_answer_is_generated_aborts_every_choice(server: ServerProc) -> None:
    aborted_key = 'inferd_llm_sequences_ended_total{model="sim-llm",outcome="aborted",version="1"}'
    gone_key = 'inferd_llm_client_aborts_total{model="sim-llm",version="1"}'
    streams_key = 'inferd_llm_streams{model="sim-llm",version="1"}'
    aborted_before = await ametric(server, aborted_key)
    gone_before = await ametric(server, gone_key)
    body = {"model": "sim-llm", "prompt": "a long story", "max_tokens": 1500, "n": 2}

    async def ask() -> None:
        async with aiohttp.ClientSession() as http, http.post(f"{server.url}/v1/completions", json=body) as r:
            await r.read()

    request = asyncio.ensure_future(ask())
    for _ in range(200):  # until both choices run
        if await ametric(server, streams_key) == 2:
            break
        await asyncio.sleep(0.02)
    assert not request.done()
    request.cancel()  # the session closes: the connection goes away before the answer
    with pytest.raises(asyncio.CancelledError):
        await request
    aborted = aborted_before
    for _ in range(100):
        aborted = await ametric(server, aborted_key)
        if aborted >= aborted_before + 2:
            break
        await asyncio.sleep(0.05)
    assert aborted == aborted_before + 2, "the engine never aborted the choices of the client that left"
    assert await ametric(server, gone_key) == gone_before + 2
    assert await ametric(server, streams_key) == 0


def test_default_models_include_sim_llm_and_smollm2(tmp_path: Path) -> None:
    from inferd.kinds.repository import default_models

    assert [m.name for m in default_models(tmp_path)] == ["sim", "minilm", "sim-llm", "smollm2"]


async def test_token_timing_metrics(server: ServerProc) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    before = await ametric(server, 'inferd_time_to_first_token_seconds_count{model="sim-llm",version="1"}')
    stream = client.completions.create(model="sim-llm", prompt="time me please", max_tokens=6, stream=True)
    assert sum(1 for _ in stream) >= 6
    assert (
        await ametric(server, 'inferd_time_to_first_token_seconds_count{model="sim-llm",version="1"}')
        == before + 1
    )
    assert await ametric(server, 'inferd_inter_token_latency_seconds_count{model="sim-llm",version="1"}') >= 5
    assert (
        await ametric(server, 'inferd_llm_request_duration_seconds_count{model="sim-llm",version="1"}') >= 1
    )
    assert await ametric(server, 'inferd_generation_tokens_total{model="sim-llm",version="1"}') >= 6


def test_admin_models_reports_llm_engines(server: ServerProc) -> None:
    import json
    import urllib.request

    client(server).completions.create(model="sim-llm", prompt="count me", max_tokens=3)
    with urllib.request.urlopen(f"{server.admin_url}/admin/models", timeout=5) as r:
        llm = json.loads(r.read())["llm_models"]["sim-llm"]
    assert llm["ready"] is True and llm["workers"] == 1
    assert 0.0 <= llm["kv_usage"] <= 1.0 and llm["rejected"] == 0


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(server: ServerProc) -> None:
    messages = [{"role": "user", "content": "tell me everything"}]
    prompt = sim_llm_chat_prompt(messages)
    prompt_tokens = len(prompt.split())
    c = client(server)
    out = c.chat.completions.create(model="short", messages=messages, seed=1)
    assert out.usage.completion_tokens == 64 - prompt_tokens
    assert out.choices[0].message.content == expected(prompt, 1, 64 - prompt_tokens)
    assert out.choices[0].finish_reason == "length"
    plain = c.completions.create(model="short", prompt="tell me everything", seed=1)
    assert plain.usage.completion_tokens == 16  # completions keep OpenAI's default of 16


async def llm_gauges(server: ServerProc, model: str) -> tuple[float, float]:
    """(KV usage ratio, running sequences) of the model's engines, as of their last step."""
    kv = await ametric(server, f'inferd_llm_kv_usage_ratio{{model="{model}",version="1"}}')
    return kv, await ametric(server, f'inferd_llm_sequences{{model="{model}",state="running",version="1"}}')


async def until_engine_idle(server: ServerProc, model: str) -> None:
    for _ in range(200):
        if await llm_gauges(server, model) == (0.0, 0.0):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine kept KV blocks or sequences: {await llm_gauges(server, model)}")


async def test_deadline_is_a_504_and_frees_the_sequence_in_the_engine(server: ServerProc) -> None:
    aborted_key = 'inferd_llm_sequences_ended_total{model="sim-llm",outcome="aborted",version="1"}'
    aborted_before = await ametric(server, aborted_key)
    body = {"model": "sim-llm", "prompt": "a story with no end", "max_tokens": 1500}
    async with aiohttp.ClientSession() as http:
        headers = {"X-Request-Timeout-Ms": "300"}
        async with http.post(f"{server.url}/v1/completions", json=body, headers=headers) as r:
            assert r.status == 504
            error = (await r.json())["error"]
    assert error["code"] == "DeadlineExceeded" and "ran past its deadline" in error["message"]
    await until_engine_idle(server, "sim-llm")
    assert await ametric(server, aborted_key) == aborted_before + 1
    assert await ametric(server, 'inferd_llm_streams{model="sim-llm",version="1"}') == 0


async def test_deadline_mid_stream_is_an_error_event_and_frees_the_kv_blocks(server: ServerProc) -> None:
    body = {"model": "sim-llm", "prompt": "stream a story", "max_tokens": 1500, "stream": True}
    events: list[bytes] = []
    cut = 'inferd_requests_total{model="sim-llm",outcome="deadline",protocol="http",version="1"}'
    cut_before = await ametric(server, cut, absent=0.0)
    async with aiohttp.ClientSession() as http:
        headers = {"X-Request-Timeout-Ms": "1500"}
        async with http.post(f"{server.url}/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(line)
                if len(events) == 3:
                    kv_while_running, running = await llm_gauges(server, "sim-llm")
    assert kv_while_running > 0 and running == 1  # the blocks the deadline must free
    assert events[-1] == b"data: [DONE]\n"
    assert json.loads(events[-2][6:])["error"]["code"] == "DeadlineExceeded"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2])
    words = text.split()
    assert 3 <= len(words) < 1500 and words == sim_llm_tokens("stream a story", None, len(words))
    await until_engine_idle(server, "sim-llm")
    assert await ametric(server, cut) == cut_before + 1  # the stream is accounted as cut by its deadline


def test_no_default_deadline_cuts_a_long_answer_short(server: ServerProc) -> None:
    out = client(server).completions.create(model="sim-llm", prompt="take your time", max_tokens=120, seed=2)
    assert out.choices[0].text == expected("take your time", 2, 120)  # ~0.6 s, past the 200 ms default
