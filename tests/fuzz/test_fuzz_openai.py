"""Fuzzing the OpenAI request parsing as functions: the body decoders of /v1/completions,
/v1/chat/completions and /v1/embeddings, the prompt and input checks after them, and the request as the
upstream relay rewrites it. Whatever the bytes, the answer is a request or BadRequest naming the problem."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from inferd.api import completions, openai, upstream
from inferd.api.http import decode_json
from inferd.errors import BadRequest
from tests.fuzz.profiles import fuzz, time_limit

pytestmark = pytest.mark.timeout(time_limit(60))

DECODERS = [
    completions._named,
    completions._completion_decoder,
    completions._chat_decoder,
    openai._decoder,
    upstream._request,
]

leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
anything = st.recursive(
    leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=15,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "input",
    "max_tokens",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "priority",
    "encoding_format",
    "dimensions",
    "user",
    "ignore_eos",
]
requests = st.dictionaries(st.sampled_from(FIELDS), anything, max_size=8)


def parse(decoder: msgspec.json.Decoder, body: bytes) -> object | None:
    try:
        return decode_json(decoder, body, "request", "send a request")
    except BadRequest as exc:
        assert exc.message
        return None


@fuzz()
@given(st.sampled_from(DECODERS), st.binary(max_size=400))
@example(completions._chat_decoder, b"[" * 100_000)
@example(openai._decoder, b'{"model":"m","input":"\\ud800"}')
def test_raw_bodies_decode_or_raise_bad_request(decoder: msgspec.json.Decoder, body: bytes) -> None:
    parse(decoder, body)


@fuzz()
@given(st.sampled_from(DECODERS), requests)
def test_structured_bodies_decode_or_raise_bad_request(decoder: msgspec.json.Decoder, req: dict) -> None:
    parse(decoder, json.dumps(req).encode())


@fuzz()
@given(requests, st.integers(1, 2048))
@example({"model": "m", "input": ["\ud800"]}, 8)
@example({"model": "m", "input": [[1, 2]]}, 8)
def test_embedding_inputs_are_texts_or_bad_request(req: dict, limit: int) -> None:
    req.setdefault("model", "m")
    req.setdefault("input", "x")
    decoded = parse(openai._decoder, json.dumps(req).encode())
    if decoded is None:
        return
    try:
        texts = openai._texts(decoded, limit)  # type: ignore[arg-type]
    except BadRequest:
        return
    assert 1 <= len(texts) <= limit
    for t in texts:
        t.encode()  # valid Unicode


@fuzz()
@given(requests)
def test_completion_prompts_are_one_string_or_bad_request(req: dict) -> None:
    req.setdefault("model", "m")
    req.setdefault("prompt", "")
    decoded = parse(completions._completion_decoder, json.dumps(req).encode())
    if decoded is None:
        return
    try:
        prompt = completions._prompt_text(decoded.prompt)  # type: ignore[attr-defined]
    except BadRequest:
        return
    assert isinstance(prompt, str)


@fuzz()
@given(st.dictionaries(st.text(max_size=5), anything, max_size=6), st.booleans(), st.text(max_size=10))
@example({"stream_options": 5}, True, "up")
@example({"stream_options": None}, True, "up")
def test_upstream_payload_keeps_the_request_and_names_the_upstream_model(
    req: dict, stream: bool, model: str
) -> None:
    sent = json.loads(upstream.upstream_payload(req, model, stream))
    assert sent["model"] == model
    assert {k: v for k, v in sent.items() if k not in ("model", "stream_options")} == {
        k: v for k, v in req.items() if k not in ("model", "stream_options")
    }
    if stream and (req.get("stream_options") is None or isinstance(req.get("stream_options"), dict)):
        assert sent["stream_options"]["include_usage"] is True


class _RefusingTemplate:
    """A tokenizer whose chat template refuses some messages, as Hugging Face templates do."""

    def chat_prompt(self, messages: list[dict[str, object]]) -> str:
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"role {m['role']!r} is not supported")
            assert isinstance(m["content"], str)  # null content arrives as empty text
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


messages = st.lists(
    st.builds(
        completions.ChatMessage,
        st.one_of(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=6)),
        st.one_of(st.none(), st.text(max_size=10)),
    ),
    max_size=4,
)


@fuzz(0.5)
@given(messages)
def test_chat_messages_format_or_raise_bad_request(msgs: list[completions.ChatMessage]) -> None:
    try:
        prompt = completions.chat_prompt(_RefusingTemplate(), "m", msgs)  # type: ignore[arg-type]
    except BadRequest as exc:
        assert "cannot format these messages" in exc.message
        return
    assert prompt.count("\n") == len(msgs)


def test_null_content_with_the_smollm2_chat_template_is_empty_text() -> None:
    """OpenAI allows `"content": null`; smollm2's chat template concatenated it and raised TypeError (a
    500)."""
    from inferd.kinds.llm.llama_cpp import smollm2_available, smollm2_config
    from inferd.models.loader import load_model_class

    if not smollm2_available():
        pytest.skip("llama-cpp-python or the SmolLM2 GGUF file is missing (scripts/setup)")
    config = smollm2_config()
    tokenizer = load_model_class(config.implementation).front_end_tokenizer(config)  # type: ignore[attr-defined]
    prompt = completions.chat_prompt(tokenizer, "smollm2", [completions.ChatMessage("user", None)])
    assert prompt.endswith("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")
