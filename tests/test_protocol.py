"""The server's protocol without HTTP (:mod:`infer.tools.protocol`): request JSON to sampling
parameters and prompt ids, generated text to OpenAI's bodies and chunks."""

from __future__ import annotations

import json

import pytest

from infer.core.models import load_verifier
from infer.tools import protocol
from infer.tools.protocol import APIError
from infer.tools.serve import Limits

LIMITS = Limits(max_tokens=64)


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    return e.value


def test_max_tokens_and_its_defaults():
    params, _ = protocol.sampling_from({"max_tokens": 5, "max_completion_tokens": None}, LIMITS, 3, 100)
    assert params.max_new_tokens == 5  # an explicit null is as good as absent
    assert protocol.sampling_from({"max_completion_tokens": 7, "max_tokens": 5}, LIMITS, 3, 100)[0].max_new_tokens == 7
    assert protocol.sampling_from({}, LIMITS, 3, 100)[0].max_new_tokens == 16  # a completion: 16, as OpenAI
    assert protocol.sampling_from({"messages": []}, LIMITS, 3, 40)[0].max_new_tokens == 37  # a chat: the room left
    e = refused(protocol.sampling_from, {"max_tokens": 65}, LIMITS, 3, 1000)
    assert e.status == 400 and e.code == "max_tokens_exceeded"
    assert refused(protocol.sampling_from, {"max_tokens": 50}, LIMITS, 60, 100).code == "context_length_exceeded"


@pytest.mark.parametrize("key, value", [("n", True), ("n", 2), ("n", 1.0), ("logprobs", True), ("logprobs", 1),
                                        ("best_of", 2), ("logit_bias", {"1": 5}), ("tools", [{"type": "function"}]),
                                        ("presence_penalty", 0.5), ("frequency_penalty", False),
                                        ("response_format", {"type": "json_object"}), ("tool_choice", "auto")])
def test_what_is_not_implemented_is_a_422(key, value):
    e = refused(protocol.sampling_from, {key: value}, LIMITS, 3, 100)
    assert e.status == 422 and e.param == key


@pytest.mark.parametrize("key, value", [("n", 1), ("n", None), ("logprobs", False), ("logprobs", 0), ("best_of", 1),
                                        ("logit_bias", {}), ("tools", []), ("presence_penalty", 0.0),
                                        ("frequency_penalty", 0), ("response_format", {"type": "text"}),
                                        ("tool_choice", "none"), ("echo", False), ("suffix", ""), ("top_logprobs", 0)])
def test_neutral_values_are_taken(key, value):
    protocol.sampling_from({key: value}, LIMITS, 3, 100)


def test_sampling_fields():
    params, stop = protocol.sampling_from({"temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": -1, "stop": "x"},
                                          LIMITS, 3, 100)
    assert (params.temperature, params.top_p, params.top_k, params.seed, stop) == (0.5, 0.9, 7, 2**64 - 1, ["x"])
    assert refused(protocol.sampling_from, {"seed": True}, LIMITS, 3, 100).param == "seed"
    assert refused(protocol.sampling_from, {"stop": ["a"] * 5}, LIMITS, 3, 100).param == "stop"


def test_chat_turns_take_text_parts_and_the_developer_role():
    turns = protocol.chat_turns([{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                 {"role": "user", "content": "hi"}])
    assert turns == [{"role": "system", "content": "a\nb"}, {"role": "user", "content": "hi"}]
    for bad in ([], "hi", [{"role": "tool", "content": "x"}], [{"role": "user", "content": None}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], [{"role": "user"}]):
        assert refused(protocol.chat_turns, bad).status == 422, bad


def test_bodies():
    assert protocol.parse_body(b'{"a": 1}') == {"a": 1}
    e = refused(protocol.parse_body, b"[" * 100_000 + b"]" * 100_000)
    assert e.status == 400 and "nested too deeply" in e.message
    assert refused(protocol.parse_body, b"{nope").status == 400
    assert refused(protocol.parse_body, b"[1]").status == 422
    assert refused(protocol.parse_body, b"\xff\xfe").status == 400
    protocol.check_content_type({"content-type": "application/json; charset=utf-8"})
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        assert refused(protocol.check_content_type, {"content-type": kind} if kind else {}).status == 415


def test_stream_options_and_model():
    assert protocol.stream_options({}) == (False, False)
    assert protocol.stream_options({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    assert refused(protocol.stream_options, {"stream": "yes"}).status == 422
    protocol.check_model({"model": "m"}, "m")
    protocol.check_model({}, "m")
    assert refused(protocol.check_model, {"model": "gpt-4"}, "m").code == "model_not_found"


@pytest.mark.parametrize("engine_reason, stop_string, want", [
    ("eos", False, "stop"), ("stop", False, "stop"), ("length", False, "length"), ("length", True, "stop"),
    (None, False, "abort"), (None, True, "stop")])
def test_finish_reasons(engine_reason, stop_string, want):
    assert protocol.finish_reason(engine_reason, stop_string) == want


def test_stream_text_holds_back_a_possible_stop_string_and_cuts_before_it():
    tok = load_verifier("tiny-random:llama").tokenizer
    text = protocol.StreamText(tok, ["END"])
    ids = tok("abc EN", add_special_tokens=False)["input_ids"]
    first = text.push(ids, final=False)
    assert first == "abc " and not text.done  # "EN" may start "END"
    assert text.push(tok("D more", add_special_tokens=False)["input_ids"], final=False) == ""
    assert text.done and text.text.startswith("abc END")


def test_response_shapes():
    counts = protocol.usage(3, 2)
    assert counts == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    body = protocol.completion_body("chatcmpl-1", True, "m", "hi", "stop", counts)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    event = protocol.chunk_event("cmpl-1", False, "m", "x", None, include_usage=True)
    data = json.loads(event[len("data: "):])
    assert event.endswith("\n\n") and data["choices"][0]["text"] == "x" and data["usage"] is None
    first = json.loads(protocol.chunk_event("c", True, "m", None, None, first=True)[6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(protocol.usage_event("c", True, "m", counts)[6:])["choices"] == []
    assert protocol.SSE_DONE == "data: [DONE]\n\n"
