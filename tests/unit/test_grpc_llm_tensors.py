"""Triton's vLLM-backend tensors <-> GenerationRequest and the text responses (grpc_edge/llm.py): raw
and typed contents, vLLM's defaults for echoing the prompt, sampling_parameters' keys and values (with
REST's checks), the refusals, and the streamed responses' final flag."""

from __future__ import annotations

import json
from typing import Any

import pytest

from inferd.api.binary import decode_bytes_elements, encode_bytes_elements
from inferd.errors import BadRequest
from inferd.grpc_edge import llm
from inferd.grpc_edge.protos import grpc_service_pb2 as pb
from inferd.kinds.llm.service import GenerationRequest


def raw_request(**tensors: Any) -> pb.ModelInferRequest:
    """A request as tritonclient sends it: every tensor of shape [1] in raw_input_contents."""
    req = pb.ModelInferRequest(model_name="sim-llm", id="r1")
    for name, value in tensors.items():
        inp = req.inputs.add(name=name, shape=[1])
        if isinstance(value, bool):
            inp.datatype = "BOOL"
            req.raw_input_contents.append(bytes([value]))
        else:
            inp.datatype = "BYTES"
            data = value if isinstance(value, bytes) else value.encode()
            req.raw_input_contents.append(encode_bytes_elements([data]))
    return req


def texts_of(response: pb.ModelInferResponse) -> list[str]:
    (out,) = response.outputs
    assert out.name == "text_output" and out.datatype == "BYTES"
    (raw,) = response.raw_output_contents
    return [b.decode() for b in decode_bytes_elements(memoryview(raw), out.shape[0], out.name)]


def test_the_tensors_read_are_those_the_model_config_declares() -> None:
    from inferd.grpc_edge.model_config import LLM_OUTPUTS

    assert llm.INPUTS == {"text_input": "BYTES", "stream": "BOOL", "sampling_parameters": "BYTES", "exclude_input_in_output": "BOOL"}
    assert [(t.name, t.datatype) for t in LLM_OUTPUTS] == [(llm.TEXT_OUTPUT, "BYTES")]


def test_prompt_alone_is_a_whole_answer_that_echoes_the_prompt() -> None:
    text = llm.read_text_request(raw_request(text_input="hello there"))
    assert text.generation == GenerationRequest("hello there")
    assert text.prompt == "hello there" and not text.stream and text.echo
    assert llm.whole_texts(text, [" general"]) == ["hello there general"]


def test_streamed_request_does_not_echo_unless_asked() -> None:
    streamed = llm.read_text_request(raw_request(text_input="p", stream=True))
    assert streamed.stream and not streamed.echo
    echoed = llm.read_text_request(raw_request(text_input="p", stream=True, exclude_input_in_output=False))
    assert echoed.stream and echoed.echo
    plain = llm.read_text_request(raw_request(text_input="p", exclude_input_in_output=True))
    assert not plain.echo and llm.whole_texts(plain, ["x"]) == ["x"]


def test_sampling_parameters_as_numbers_or_strings() -> None:
    params = {"max_tokens": "12", "temperature": 0.5, "top_p": "0.9", "seed": 7, "stop": ["\n", ""]}
    text = llm.read_text_request(raw_request(text_input="p", sampling_parameters=json.dumps(params)))
    assert text.generation == GenerationRequest(
        "p", max_tokens=12, temperature=0.5, top_p=0.9, seed=7, stops=("\n",)
    )
    more = {"n": 3, "ignore_eos": "true", "stop": "END", "top_k": 40, "presence_penalty": 0.1, "seed": None}
    text = llm.read_text_request(raw_request(text_input="p", sampling_parameters=json.dumps(more)))
    assert text.generation == GenerationRequest("p", n=3, ignore_eos=True, stops=("END",))
    assert text.choices == 3


def test_typed_contents_are_read_as_raw_ones() -> None:
    req = pb.ModelInferRequest(model_name="sim-llm")
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1]).contents.bytes_contents.append(b"hi")
    req.inputs.add(name="stream", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    params = req.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    params.contents.bytes_contents.append(b'{"max_tokens": 4}')
    text = llm.read_text_request(req)
    assert text.generation == GenerationRequest("hi", max_tokens=4) and text.stream


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("{not json", "input 'sampling_parameters': malformed JSON"),
        ("[1, 2]", "input 'sampling_parameters': invalid value: Expected `object`, got `array`"),
        ("", "input 'sampling_parameters' is empty"),
        ('{"a": ' + "[" * 10_000, "input 'sampling_parameters': JSON is nested too deeply"),
        ('{"temprature": 0.1, "zeta": 1}', "unknown keys ['temprature', 'zeta']"),
        ('{"max_tokens": "ten"}', "max_tokens must be an integer, got 'ten'"),
        ('{"max_tokens": 1.5}', "max_tokens must be an integer, got 1.5"),
        ('{"seed": true}', "seed must be an integer, got True"),
        ('{"temperature": "hot"}', "temperature must be a number, got 'hot'"),
        ('{"temperature": "nan"}', "temperature must be a finite number"),
        ('{"ignore_eos": "yes"}', "ignore_eos must be true or false"),
        ('{"stop": [1]}', "stop must be a string or a list of strings"),
        ('{"temperature": 3}', "temperature must be between 0 and 2, got 3.0"),  # REST's check
        ('{"n": 17}', "n must be between 1 and 16, got 17"),
        ('{"max_tokens": 0}', "max_tokens must be at least 1, got 0"),
    ],
)
def test_bad_sampling_parameters_are_refused_naming_the_value(params: str, message: str) -> None:
    with pytest.raises(BadRequest) as err:
        llm.read_text_request(raw_request(text_input="p", sampling_parameters=params))
    assert message in err.value.message


def test_request_without_text_input_is_refused() -> None:
    with pytest.raises(BadRequest, match="input 'text_input' is missing"):
        llm.read_text_request(raw_request(stream=True))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.inputs[0].__setattr__("name", "prompt"), "unknown input 'prompt'"),
        (lambda r: setattr(r.inputs[0], "datatype", "INT32"), "must be BYTES, got 'INT32'"),
        (lambda r: r.inputs[0].shape.extend([2]), "must hold one element, got shape [1, 2]"),
        (lambda r: r.inputs[0].shape.__setitem__(0, 10**12), "must hold one element"),
        (lambda r: r.raw_input_contents.append(b"x"), "raw_input_contents holds 2 tensors"),
        (lambda r: r.outputs.add(name="logits"), "unknown output 'logits'"),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\x09\x00\x00\x00ab"), "runs past the tensor's data"),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\x02\x00"), "truncated BYTES element length"),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\x01\x00\x00\x00\xff"), "is not UTF-8 text"),
        (lambda r: r.inputs[0].contents.bytes_contents.append(b"x"), "has contents and raw_input_contents"),
    ],
)
def test_bad_tensors_are_refused(mutate: Any, message: str) -> None:
    req = raw_request(text_input="p")
    mutate(req)
    with pytest.raises(BadRequest) as err:
        llm.read_text_request(req)
    assert message in err.value.message


def test_bad_bool_and_repeated_inputs_are_refused() -> None:
    req = raw_request(text_input="p", stream=True)
    req.raw_input_contents[1] = b"\x01\x01"
    with pytest.raises(BadRequest, match="1 BOOL element"):
        llm.read_text_request(req)
    twice = raw_request(text_input="p")
    twice.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    twice.raw_input_contents.append(encode_bytes_elements([b"q"]))
    with pytest.raises(BadRequest, match="given twice"):
        llm.read_text_request(twice)
    empty = pb.ModelInferRequest()
    empty.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    with pytest.raises(BadRequest, match=r"contents\.bytes_contents holds 0"):
        llm.read_text_request(empty)


def test_text_response_carries_text_output() -> None:
    response = llm.text_response("r1", "sim-llm", "2", ["a", "bc"])
    assert (response.id, response.model_name, response.model_version) == ("r1", "sim-llm", "2")
    assert texts_of(response) == ["a", "bc"] and not response.parameters
    empty = llm.text_response("r1", "m", "1", None)
    assert not empty.outputs and not empty.raw_output_contents


def test_streamed_pieces_end_with_one_final_response() -> None:
    text = llm.read_text_request(raw_request(text_input="say", stream=True, exclude_input_in_output=False))
    responses = llm.PieceResponses("r9", "sim-llm", "1", text, empty_final=True)
    first = responses.piece(0, " one", None)
    assert first is not None and texts_of(first[0]) == ["say one"] and not first[1]  # the prompt first
    assert first[0].id == "r9"
    assert responses.piece(0, "", None) is None  # no text, not the end: nothing to send
    last = responses.piece(0, " two", "length")
    assert last is not None and texts_of(last[0]) == [" two"] and last[1]
    assert responses.ended and responses.last() is None


def test_each_choice_streamed_starts_with_the_prompt_when_echoed() -> None:
    sampling = json.dumps({"n": 2})
    req = raw_request(text_input="p:", stream=True, exclude_input_in_output=False, sampling_parameters=sampling)
    responses = llm.PieceResponses("r", "m", "1", llm.read_text_request(req), empty_final=True)
    pieces = [responses.piece(1, "b", None), responses.piece(0, "a", None), responses.piece(1, "c", "stop")]
    assert [texts_of(p[0]) for p in pieces if p is not None] == [["", "p:b"], ["p:a", ""], ["", "c"]]


def test_several_choices_end_when_the_last_one_does() -> None:
    sampling = json.dumps({"n": 2})
    text = llm.read_text_request(raw_request(text_input="p", stream=True, sampling_parameters=sampling))
    responses = llm.PieceResponses("r", "m", "1", text, empty_final=True)
    one = responses.piece(1, "b", "stop")
    assert one is not None and texts_of(one[0]) == ["", "b"] and not one[1]
    final = responses.piece(0, "", "length")  # the end, with no text: a final response without outputs
    assert final is not None and not final[0].outputs and final[1]
    assert responses.last() is None


def test_a_stream_that_ends_without_a_finish_still_gets_its_final_response() -> None:
    text = llm.read_text_request(raw_request(text_input="p", stream=True))
    responses = llm.PieceResponses("r", "m", "1", text, empty_final=True)
    final = responses.last()
    assert final is not None and final[0].id == "r" and not final[0].outputs and final[1]
    assert responses.last() is None


def test_a_final_response_without_text_has_empty_texts_unless_the_client_takes_empty_ones() -> None:
    sampling = json.dumps({"n": 2})
    text = llm.read_text_request(raw_request(text_input="p", stream=True, sampling_parameters=sampling))
    responses = llm.PieceResponses("r", "m", "1", text, empty_final=False)
    assert responses.piece(0, "", "stop") is None
    final = responses.piece(1, "", "length")
    assert final is not None and texts_of(final[0]) == ["", ""] and final[1]
    request = raw_request(text_input="p")
    assert not llm.empty_final(request)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    assert llm.empty_final(request)


def test_a_model_served_upstream_is_refused_naming_the_rest_routes() -> None:
    from types import SimpleNamespace

    from inferd.grpc_edge.text import llm_runtime

    upstream = SimpleNamespace(name="gpt", kind="upstream")
    with pytest.raises(BadRequest, match=r"model 'gpt' \(kind upstream\) is served by an external engine: call it over REST"):
        llm_runtime(upstream)  # type: ignore[arg-type]
