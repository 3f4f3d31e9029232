"""Fuzzing the HTTP front end in-process (no workers, so a request that passes every check gets 503):
whatever the method, path, headers and body, the answer is never a 500, its status is one the OpenAPI
document lists for the route, and its JSON body matches the documented schema."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.app_client import MODELS, call, check_conforms, make_app
from tests.fuzz.profiles import fuzz, time_limit

pytestmark = pytest.mark.timeout(time_limit(120))

APP = make_app()

model_names = st.sampled_from([*MODELS, "nope", "sim%20x", "\u00e9", "a" * 300])
versions = st.one_of(
    st.sampled_from(["1", "2", "0", "-1", "latest", "99999999999999999999", "\u00b2", "\u0661", "1_0"]),
    st.text(max_size=4).filter(lambda v: v and "/" not in v),
)


@st.composite
def paths(draw: st.DrawFn) -> tuple[str, str]:
    model = draw(model_names)
    base = f"/v2/models/{model}" + (f"/versions/{draw(versions)}" if draw(st.booleans()) else "")
    return draw(
        st.sampled_from(
            [
                ("GET", base),
                ("GET", base + "/ready"),
                ("POST", base + "/infer"),
                ("POST", "/v1/completions"),
                ("POST", "/v1/chat/completions"),
                ("POST", "/v1/embeddings"),
                ("GET", "/v1/models"),
                ("GET", "/v2"),
                ("GET", "/v2/health/live"),
                ("GET", "/openapi.json"),
            ]
        )
    )


header_values = st.one_of(
    st.sampled_from(
        ["", "0", "-1", "1e309", "nan", "inf", "100", "bulk", "interactive", "2", " 7 ", "\u00b2", "1_0", "1"]
    ),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=12),
)
headers = st.lists(
    st.tuples(
        st.sampled_from(
            [
                b"content-type",
                b"x-request-timeout-ms",
                b"x-priority",
                b"x-tenant",
                b"inference-header-content-length",
                b"x-inferd-model-version",
            ]
        ),
        st.one_of(
            header_values, st.sampled_from(["application/json", "text/plain", "application/json; x=1"])
        ),
    ).map(lambda kv: (kv[0], kv[1].encode("latin-1"))),
    max_size=3,
)

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_any = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@st.composite
def openai_body(draw: st.DrawFn) -> dict[str, object]:
    """A completion, chat or embeddings request with each field present or not, right-typed or not."""
    fields = {
        "model": st.one_of(model_names, json_leaf),
        "prompt": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=5), max_size=2), json_any),
        "messages": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "system", "assistant", "tool"])},
                    optional={"content": st.one_of(st.none(), st.text(max_size=20))},
                ),
                max_size=3,
            ),
            json_any,
        ),
        "input": st.one_of(st.text(max_size=10), st.lists(st.text(max_size=5), max_size=3), json_any),
        "max_tokens": st.one_of(st.integers(-2, 5000), st.integers(), json_leaf),
        "max_completion_tokens": st.one_of(st.integers(-2, 5000), json_leaf),
        "n": st.one_of(st.integers(-1, 20), json_leaf),
        "seed": st.one_of(st.integers(min_value=-(2**64), max_value=2**64), json_leaf),
        "temperature": st.one_of(st.floats(allow_nan=False), json_leaf),
        "top_p": st.one_of(st.floats(allow_nan=False), json_leaf),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), json_leaf),
        "stream": st.one_of(st.booleans(), json_leaf),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_any),
        "priority": st.one_of(
            st.sampled_from(["bulk", "interactive", "3", "\u00b2", "\u0663", " 1"]), json_leaf
        ),
        "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), json_leaf),
        "dimensions": st.one_of(st.integers(-1, 1000), json_leaf),
        "ignore_eos": st.one_of(st.booleans(), json_leaf),
    }
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=8))
    body = {name: draw(fields[name]) for name in chosen}
    if draw(st.booleans()):
        body["model"] = draw(model_names)
    return body


bodies = st.one_of(
    st.binary(max_size=300),
    st.integers(1000, 5000).map(lambda n: b'{"model":"sim-llm","prompt":"' + b"x" * n + b'"}'),
    openai_body().map(lambda b: json.dumps(b).encode()),
    json_any.map(lambda b: json.dumps(b).encode()),
)


def exchange(
    method: str, path: str, body: bytes, extra: list[tuple[bytes, bytes]], cuts: list[int] | None = None
) -> None:
    answer = asyncio.run(call(APP, method, path, body, extra, cuts))
    check_conforms(method, path, answer)


@fuzz(2)
@given(paths(), headers, bodies, st.lists(st.integers(0, 6000), max_size=4))
@example(("GET", "/v2/models/nope/ready"), [], b"", [])
@example(("POST", "/v1/completions"), [], b'{"model":"sim-llm","prompt":"hi"}', [])
@example(("POST", "/v1/embeddings"), [], b'{"model":"sim","input":"hi"}', [])
@example(("POST", "/v2/models/sim/infer"), [(b"x-priority", b"\xb2")], b"{}", [])
@example(("GET", "/v2/models/sim/versions/\u00b2"), [], b"", [])
@example(
    ("POST", "/v1/completions"),
    [(b"x-inferd-model-version", b"\xb2")],
    b'{"model":"sim-llm","prompt":"x"}',
    [],
)
@example(("POST", "/v1/completions"), [], b'{"model":"sim-llm","prompt":"' + b"x" * 2000 + b'"}', [10, 1500])
@example(("POST", "/v1/completions"), [], b'{"model":"sim-llm","prompt":"x","priority":"\\u00b2"}', [])
def test_http_answers_are_documented_and_never_500(
    route: tuple[str, str], extra: list[tuple[bytes, bytes]], body: bytes, cuts: list[int]
) -> None:
    exchange(route[0], route[1], body, extra, cuts)


@fuzz(2)
@given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), openai_body(), headers)
def test_text_requests_to_a_real_model_never_500(
    path: str, body: dict[str, object], extra: list[tuple[bytes, bytes]]
) -> None:
    body["model"] = "sim-llm"
    exchange("POST", path, json.dumps(body).encode(), extra)


def test_non_ascii_digits_in_priority_and_version_are_bad_requests() -> None:
    """'\u00b2' (latin-1 byte 0xb2 in a header) is a digit to str.isdigit() but not to int(): a priority or
    version spelled with it once answered 500."""
    cases = [
        ("POST", "/v2/models/sim/infer", [(b"x-priority", b"\xb2")], b"{}", 400),
        ("POST", "/v1/completions", [], b'{"model":"sim-llm","prompt":"x","priority":"\\u00b2"}', 400),
        ("GET", "/v2/models/sim/versions/\u00b2", [], b"", 404),
        (
            "POST",
            "/v1/completions",
            [(b"x-inferd-model-version", b"\xb2")],
            b'{"model":"sim-llm","prompt":"x"}',
            404,
        ),
    ]
    for method, path, extra, body, status in cases:
        answer = asyncio.run(call(APP, method, path, body, extra))
        assert answer.status == status, (path, answer.body)
        check_conforms(method, path, answer)


def test_admin_version_query_with_a_non_ascii_digit_is_a_bad_request() -> None:
    from aiohttp.test_utils import make_mocked_request

    from inferd.api.admin import _version
    from inferd.errors import BadRequest

    with pytest.raises(BadRequest, match="whole number"):
        _version(make_mocked_request("POST", "/admin/models/sim/update?version=%C2%B2"))
    assert _version(make_mocked_request("POST", "/admin/models/sim/update?version=2")) == 2


async def test_a_body_over_the_limit_in_its_last_message_is_refused_without_waiting_for_more() -> None:
    """The body's last message crossed the limit: the 413 comes at once. The drain once asked for another
    message, which never comes before the client leaves, and held the 413 for DRAIN_MAX_S."""
    from inferd.api.asgi import HttpRequest
    from inferd.api.http import read_body
    from inferd.api.peer import AsgiPeer
    from inferd.errors import PayloadTooLarge

    messages = [
        {"type": "http.request", "body": b"x" * 600, "more_body": True},
        {"type": "http.request", "body": b"x" * 600, "more_body": False},
    ]

    async def receive() -> dict[str, object]:
        assert messages, "receive() called after the body's last message"
        return messages.pop(0)

    request = HttpRequest({"method": "POST", "path": "/v1/completions", "headers": []}, AsgiPeer(receive), {})
    with pytest.raises(PayloadTooLarge):
        await read_body(request, 1024)
    assert request.close_connection
