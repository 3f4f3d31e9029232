"""Triton's vLLM-backend tensors over gRPC <-> a `GenerationRequest` (kinds/llm/service.py) and the
`ModelInferResponse`s that carry its text back. Pure: no I/O, no runtime (grpc_edge/text.py runs them).

Request tensors (each of one element, any shape whose product is 1; in `raw_input_contents` as
tritonclient sends them, or in typed `contents`, never both):

    text_input               BYTES  the prompt (UTF-8); required
    stream                   BOOL   one response per text piece (ModelStreamInfer only); default false
    sampling_parameters      BYTES  a JSON object, vLLM's SamplingParams (below); default {}
    exclude_input_in_output  BOOL   false: the prompt is prepended to the text (to the first piece when
                                    streamed); absent: prepended unless streamed (vLLM's defaults)

Any other input, or a requested output other than `text_output`, is refused (INVALID_ARGUMENT).

sampling_parameters: the keys inferd honors are `max_tokens`, `temperature`, `top_p`, `seed`, `stop`
(a string or a list of them), `n` and `ignore_eos`; numbers may be JSON numbers or strings holding them
and booleans JSON booleans or "true"/"false" (the vLLM backend's clients send strings). vLLM's other
SamplingParams keys (`top_k`, `presence_penalty`, ...) are accepted and ignored, as the REST routes
ignore OpenAI fields they do not implement; any other key is refused naming it, as vLLM refuses it. The
values are then checked as on REST (`GenerationRequest.checked`: the same messages).

Answers: `text_output` BYTES of shape [n] (one element per choice) in `raw_output_contents`. Streamed,
each piece is one response whose other choices' elements are empty; the one that ends the last choice
is the request's last (grpc_edge/stream.py marks it `triton_final_response`); when it has no text it
carries no outputs if the request's `triton_enable_empty_final_response` parameter is true (Triton's
empty final response), else empty texts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from inferd.api import binary
from inferd.api.http import decode_json
from inferd.errors import BadRequest
from inferd.grpc_edge.model_config import LLM_INPUTS
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.kinds.llm.service import GenerationRequest

TEXT_INPUT = "text_input"
STREAM = "stream"
SAMPLING = "sampling_parameters"
EXCLUDE_INPUT = "exclude_input_in_output"
TEXT_OUTPUT = "text_output"
EMPTY_FINAL = "triton_enable_empty_final_response"

INPUTS = {t.name: t.datatype for t in LLM_INPUTS}
"""Every input an LLM model takes over gRPC, with its datatype, as its ModelConfig and ModelMetadata
declare them (grpc_edge/model_config.py)."""

_FLOATS = ("temperature", "top_p")
_INTS = ("max_tokens", "seed", "n")
_BOOLS = ("ignore_eos",)
_INTEGER = re.compile(r"\s*-?[0-9]+\s*")
HONORED = (*_INTS, *_FLOATS, "stop", *_BOOLS)
"""The sampling_parameters keys that change the text."""
IGNORED = frozenset(
    {
        "best_of",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "top_k",
        "min_p",
        "use_beam_search",
        "length_penalty",
        "early_stopping",
        "stop_token_ids",
        "include_stop_str_in_output",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "bad_words",
        "allowed_token_ids",
        "guided_decoding",
        "logit_bias",
        "output_kind",
    }
)
"""vLLM SamplingParams keys accepted and ignored (inferd's engines have no such knob)."""


_sampling = msgspec.json.Decoder(dict[str, Any])


@dataclass(frozen=True, slots=True)
class TextRequest:
    """An LLM request read from its tensors."""

    prompt: str
    generation: GenerationRequest
    stream: bool
    """One response per text piece (else one response with the whole text)."""
    echo: bool
    """Prepend the prompt to the text (to the first piece when streamed)."""

    @property
    def choices(self) -> int:
        return self.generation.n


def read_text_request(request: pb.ModelInferRequest) -> TextRequest:
    """The request's tensors read and checked: a BadRequest naming the first bad one (sampling values
    are checked as REST checks them: `GenerationRequest.checked`)."""
    for out in request.outputs:
        if out.name != TEXT_OUTPUT:
            raise BadRequest(f"unknown output {out.name!r}: an LLM model answers {TEXT_OUTPUT!r} only")
    values = _tensor_values(request)
    if TEXT_INPUT not in values:
        raise BadRequest(f"input {TEXT_INPUT!r} is missing: an LLM model takes its prompt as BYTES in it")
    try:
        prompt = values[TEXT_INPUT].decode()
    except UnicodeDecodeError as exc:
        raise BadRequest(f"input {TEXT_INPUT!r} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    stream = bool(values.get(STREAM, False))
    exclude = values.get(EXCLUDE_INPUT)
    sampling = sampling_parameters(values[SAMPLING]) if SAMPLING in values else {}
    generation = GenerationRequest(prompt, **sampling)
    generation.checked()  # the same BadRequest as REST's, before anything else
    echo = not stream if exclude is None else not exclude
    return TextRequest(prompt, generation, stream, echo)


def _tensor_values(request: pb.ModelInferRequest) -> dict[str, Any]:
    """Each input's one element (bytes for BYTES, bool for BOOL), by name."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadRequest(
            f"raw_input_contents holds {len(raw)} tensors but the request has {len(request.inputs)} inputs"
        )
    values: dict[str, Any] = {}
    for i, inp in enumerate(request.inputs):
        name = inp.name
        datatype = INPUTS.get(name)
        if datatype is None:
            known = ", ".join(INPUTS)
            raise BadRequest(f"unknown input {name!r}: an LLM model takes {known}")
        if name in values:
            raise BadRequest(f"input {name!r} is given twice")
        if inp.datatype != datatype:
            raise BadRequest(f"input {name!r} must be {datatype}, got {inp.datatype!r}")
        if any(d < 0 for d in inp.shape) or math.prod(inp.shape) != 1:
            raise BadRequest(f"input {name!r} must hold one element, got shape {list(inp.shape)}")
        has_contents = inp.HasField("contents")
        if raw and has_contents:
            raise BadRequest(f"input {name!r} has contents and raw_input_contents is given too: send one")
        if raw:
            values[name] = _from_raw(memoryview(raw[i]), datatype, name)
        else:
            values[name] = _from_contents(inp.contents, datatype, name)
    return values


def _from_raw(raw: memoryview, datatype: str, name: str) -> bytes | bool:
    if datatype == "BYTES":
        return binary.decode_bytes_elements(raw, 1, name)[0]
    if len(raw) != 1:
        raise BadRequest(f"input {name!r}: shape holds 1 BOOL element (1 byte) but its raw data is {len(raw)} bytes")
    return raw[0] != 0


def _from_contents(contents: pb.InferTensorContents, datatype: str, name: str) -> bytes | bool:
    elements: Sequence[Any] = contents.bytes_contents if datatype == "BYTES" else contents.bool_contents
    if len(elements) != 1:
        field = "bytes_contents" if datatype == "BYTES" else "bool_contents"
        raise BadRequest(f"input {name!r}: shape holds 1 element but contents.{field} holds {len(elements)}")
    return elements[0]


def sampling_parameters(raw: bytes) -> dict[str, Any]:
    """sampling_parameters' JSON as `GenerationRequest` fields: the honored keys converted, vLLM's
    others dropped, any other key refused naming it."""
    if not raw:
        raise BadRequest(f"input {SAMPLING!r} is empty: send a JSON object (or leave the input out)")
    try:
        params = decode_json(_sampling, raw, "value", "")
    except BadRequest as exc:  # REST's message (malformed, nested too deeply, not an object), named
        raise BadRequest(f"input {SAMPLING!r}: {exc.message}") from None
    unknown = sorted(k for k in params if k not in HONORED and k not in IGNORED)
    if unknown:
        raise BadRequest(f"{SAMPLING} has unknown keys {unknown}: inferd honors {list(HONORED)}")
    fields: dict[str, Any] = {}
    for key, value in params.items():
        if value is None or key in IGNORED:
            continue
        if key in _INTS:
            fields[key] = _int(key, value)
        elif key in _FLOATS:
            fields[key] = _float(key, value)
        elif key in _BOOLS:
            fields[key] = _bool(key, value)
        else:
            fields["stops"] = _stops(value)
    return fields


def _int(key: str, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _INTEGER.fullmatch(value):
        return int(value)
    raise BadRequest(f"{SAMPLING}: {key} must be an integer, got {value!r}")


def _float(key: str, value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise BadRequest(f"{SAMPLING}: {key} must be a number, got {value!r}") from None
    else:
        raise BadRequest(f"{SAMPLING}: {key} must be a number, got {value!r}")
    if not math.isfinite(number):
        raise BadRequest(f"{SAMPLING}: {key} must be a finite number, got {value!r}")
    return number


def _bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise BadRequest(f"{SAMPLING}: {key} must be true or false, got {value!r}")


def _stops(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise BadRequest(f"{SAMPLING}: stop must be a string or a list of strings, got {value!r}")


def text_response(request_id: str, model: str, version: str, texts: Sequence[str] | None) -> pb.ModelInferResponse:
    """A response carrying `texts` (one per choice) as `text_output`, or no outputs (None)."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    if texts is not None:
        out = response.outputs.add()
        out.name = TEXT_OUTPUT
        out.datatype = "BYTES"
        out.shape.append(len(texts))
        response.raw_output_contents.append(binary.encode_bytes_elements([t.encode() for t in texts]))
    return response


Piece = tuple[pb.ModelInferResponse, bool]
"""A streamed request's response, and whether it is its last."""


class PieceResponses:
    """A streamed request's responses, one per text piece: `piece` for each (choice, text, finish) as
    `Choices.stream` yields them, and `last` once they end. The response that ends the last choice is
    the final one; the prompt goes before each choice's first piece when the request echoes it (as
    `whole_texts` puts it before each choice's whole text). A final response
    with no text carries no outputs when the client asked for empty final responses (tritonclient's
    `enable_empty_final_response`), else empty texts (so every response it reads has text_output)."""

    __slots__ = ("_echo", "_empty", "_left", "_model", "_n", "_request_id", "_unechoed", "_version", "ended")

    def __init__(self, request_id: str, model: str, version: str, text: TextRequest, empty_final: bool) -> None:
        self._request_id = request_id
        self._model = model
        self._version = version
        self._n = text.choices
        self._left = text.choices
        self._echo = text.prompt
        self._unechoed = set(range(text.choices)) if text.echo else set()
        """The choices whose first piece has not gone yet (the prompt goes before it)."""
        self._empty = None if empty_final else [""] * text.choices
        self.ended = False
        """Whether the final response has been made."""

    def piece(self, choice: int, text: str, finish: str | None) -> Piece | None:
        """The piece's response (None: a piece with no text that ends no request)."""
        if finish is not None:
            self._left -= 1
        final = self._left == 0
        if choice in self._unechoed:
            text = self._echo + text
            self._unechoed.discard(choice)
        if not text and not final:
            return None
        self.ended = final
        texts = self._empty
        if text:
            texts = [""] * self._n
            texts[choice] = text
        return text_response(self._request_id, self._model, self._version, texts), final

    def last(self) -> Piece | None:
        """The final response if no piece has made it (None: it has been made)."""
        if self.ended:
            return None
        self.ended = True
        return text_response(self._request_id, self._model, self._version, self._empty), True


def empty_final(request: pb.ModelInferRequest) -> bool:
    """Whether the client takes a final response without outputs (tritonclient sets this parameter
    when `enable_empty_final_response` is true)."""
    params = request.parameters
    return bool(params) and EMPTY_FINAL in params and params[EMPTY_FINAL].bool_param


def whole_texts(text: TextRequest, texts: Sequence[str]) -> list[str]:
    """Each choice's whole text as answered: after the prompt when the request echoes it."""
    return [text.prompt + t for t in texts] if text.echo else list(texts)
