"""Request parsing: what real clients send is accepted; wrong values are named."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from aiocb.errors import EngineDeadError, InvalidRequestError, ManagerClosedError, WouldBlock
from aiocb.params import SamplingParams
from aiocb.server.protocol import (
    APIError,
    error_from_exception,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    assert parse_completion_request({"prompt": prompt}).prompts == expected


def test_defaults_and_unknown_fields() -> None:
    request = parse_completion_request({"prompt": "x", "model": "m", "user": "u"})
    with pytest.raises(APIError, match="whatever") as caught:
        parse_completion_request({"prompt": "x", "whatever": {"a": 1}})
    assert caught.value.param == "whatever"
    sampling = request.sampling
    assert sampling.model == "m"
    assert sampling.max_tokens is None
    assert sampling.temperature == 1.0
    assert sampling.top_p == 1.0
    assert sampling.top_k == 0
    assert sampling.n == 1
    assert sampling.stop == ()
    assert not sampling.stream
    assert request.logprobs is None
    assert not request.echo


def test_sampling_fields() -> None:
    request = parse_completion_request(
        {
            "prompt": "x",
            "max_tokens": 0,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": -1,
            "seed": 7,
            "n": 3,
            "stop": "\n",
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": 5,
            "echo": True,
            "frequency_penalty": 0,
        }
    )
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.n) == (0, 0.0, 0.5, 0, 7, 3)
    assert s.stop == ("\n",)
    assert s.ignore_eos
    assert s.stream
    assert s.include_usage
    assert request.logprobs == 5
    assert request.echo


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "temperature": 3}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"one": 5}}, "logit_bias"),
        ({"prompt": "x", "min_p": 2}, "min_p"),
        ({"prompt": "x", "typical_p": 0}, "typical_p"),
        ({"prompt": "x", "epsilon_cutoff": 1}, "epsilon_cutoff"),
        ({"prompt": "x", "eta_cutoff": "0.1"}, "eta_cutoff"),
        ({"prompt": "x", "top_h": 1.5}, "top_h"),
        ({"prompt": "x", "no_repeat_ngram_size": -2}, "no_repeat_ngram_size"),
        ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"prompt": "x", "truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
        ({"prompt": "x", "bad_words": [""]}, "bad_words"),
        ({"prompt": "x", "bad_words": 5}, "bad_words"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "best_of": True}, "best_of"),
        ({"prompt": "x", "best_of": "1"}, "best_of"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "x", "max_tokens": 0, "min_tokens": 3}, "min_tokens"),
        ({"prompt": "x", "user": 123}, "user"),
        ({"prompt": "x", "metadata": "not-a-map"}, "metadata"),
        ({"prompt": "x", "metadata": {"a": 1}}, "metadata"),
        ({"prompt": "x", "store": "yes"}, "store"),
        ({"prompt": "x", "store": True}, "store"),
        ({"prompt": "x", "service_tier": 7}, "service_tier"),
        ({"prompt": "x", "request_id": ["x"]}, "request_id"),
        ({"prompt": "x", "request_id": ""}, "request_id"),
        ({"prompt": "x", "request_id": "two words"}, "request_id"),
        ({"prompt": "x", "service_tier": "priority"}, "service_tier"),
        ({"prompt": "x", "safety_identifier": 5}, "safety_identifier"),
        ({"prompt": "x", "prompt_cache_key": ["k"]}, "prompt_cache_key"),
        ({"prompt": "x", "audio": {"voice": "alloy"}}, "audio"),
    ],
)
def test_bad_completion_fields_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_completion_request(body)
    assert caught.value.status == 400
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("prompt", "said"),
    [
        (["a", 1], "mixes strings and token ids"),
        ([[1], "a"], "mixes strings and token ids"),
        ([1.0, 2.0], "token ids (integers) or lists of token ids; it holds 1.0"),
        (["a", None], "it holds None"),
    ],
)
def test_a_prompt_of_the_wrong_kind_is_named_for_what_it_holds(prompt: list[Any], said: str) -> None:
    """A list of floats was said to mix strings and token ids."""
    with pytest.raises(APIError, match=re.escape(said)) as caught:
        parse_completion_request({"prompt": prompt})
    assert caught.value.param == "prompt"


@pytest.mark.parametrize(
    ("seed", "shown"), [(1e308, "1e+308"), (2**70, "1180591620717411303424"), (1.5, "1.5"), (-(10**60), "-1000")]
)
def test_an_integer_field_out_of_range_is_shown_as_sent_and_short(seed: Any, shown: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_completion_request({"prompt": "x", "seed": seed})
    message = caught.value.message
    assert caught.value.param == "seed" and shown in message and len(message) < 120, message


def test_a_field_the_server_does_not_implement_is_taken_when_null() -> None:
    """Null asks for nothing: clients that write out every field send their unset ones so
    (each was a 400); the identifiers that replaced ``user`` are taken as it is."""
    unset = {name: None for name in ("audio", "modalities", "prediction", "reasoning_effort", "web_search_options")}
    chat = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **unset})
    assert chat.messages == [{"role": "user", "content": "hi"}]
    parse_completion_request({"prompt": "x", "safety_identifier": "u-1", "prompt_cache_key": "tenant-7", **unset})
    with pytest.raises(APIError, match="unsupported field\\(s\\): 'modalities'"):
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]})
    # (inside an object too)
    options = {"include_usage": True, "continuous_usage_stats": None, "bogus": None}
    parse_completion_request({"prompt": "x", "stream": True, "stream_options": options})
    with pytest.raises(APIError, match=r"stream_options\.bogus"):
        parse_completion_request({"prompt": "x", "stream": True, "stream_options": {**options, "bogus": True}})


def test_body_must_be_an_object() -> None:
    with pytest.raises(APIError, match="JSON object"):
        parse_completion_request(["prompt"])


def test_chat_content_parts_and_max_completion_tokens() -> None:
    request = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                {"role": "assistant", "content": None},
            ],
            "max_completion_tokens": 9,
            "max_tokens": None,
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    assert [m["content"] for m in request.messages] == ["Be brief.", "one\ntwo", ""]
    assert request.sampling.max_tokens == 9
    assert request.logprobs
    assert request.top_logprobs == 2
    assert (
        parse_chat_request({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}).sampling.max_tokens == 4
    )


def test_max_tokens_beside_max_completion_tokens_is_refused() -> None:
    messages = [{"role": "user", "content": "x"}]
    for max_tokens in (4, 9):
        with pytest.raises(APIError, match="at the same time") as caught:
            parse_chat_request({"messages": messages, "max_tokens": max_tokens, "max_completion_tokens": 9})
        assert (caught.value.status, caught.value.param) == (400, "max_tokens")
    body = {"messages": messages, "max_tokens": 4, "max_completion_tokens": None}
    assert parse_chat_request(body).sampling.max_tokens == 4


def test_a_chat_asks_for_one_new_token_at_least() -> None:
    """As vLLM's: a chat has no prompt to score (completions' ``max_tokens: 0`` with echo)."""
    messages = [{"role": "user", "content": "x"}]
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(APIError, match=field) as caught:
            parse_chat_request({"messages": messages, field: 0})
        assert (caught.value.status, caught.value.param) == (400, field)
    assert parse_completion_request({"prompt": "x", "max_tokens": 0}).sampling.max_tokens == 0


@pytest.mark.parametrize("key", ["\u00b2", "--5", "\u0663", "-5", "+5", " 5", "5\n", "1_0", "", "9" * 5000])
def test_logit_bias_keys_are_ascii_decimal_token_ids(key: str) -> None:
    with pytest.raises(APIError, match="logit_bias") as caught:
        parse_completion_request({"prompt": "x", "logit_bias": {key: 1}})
    assert (caught.value.status, caught.value.param) == (400, "logit_bias")
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={key: 1})
    assert SamplingParams(logit_bias={"5": 1, "012": -2}).logit_bias == ((5, 1.0), (12, -2.0))


SCHEMA = {"type": "object"}


def _json_schema(**spec: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, **spec}}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format.schema"),
        ({"response_format": {"type": ["json_object"]}}, "response_format.type"),
        ({"response_format": {"type": "text", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}, "strict": True}},
            "response_format.strict",
        ),
        (_json_schema(whitespace_pattern=" *"), "response_format.json_schema.whitespace_pattern"),
        (_json_schema(name=5), "response_format.json_schema.name"),
        (_json_schema(description=["a"]), "response_format.json_schema.description"),
        (_json_schema(strict="yes"), "response_format.json_schema.strict"),
        (
            {"response_format": {"type": "structural_tag", "format": {"type": "any_text"}, "triggers": []}},
            "response_format.triggers",
        ),
        (
            {"response_format": {"type": "structural_tag", "structures": [], "triggers": [], "format": {}}},
            "response_format.structures",
        ),
        (
            {"structured_outputs": {"structural_tag": {"type": "structural_tag", "format": {}, "bogus": 1}}},
            "structured_outputs.structural_tag.bogus",
        ),
        (
            {"structured_outputs": {"structural_tag": '{"structures": [{"begin": "a", "end": "b", "x": 1}]}'}},
            "structured_outputs.structural_tag.structures[0].x",
        ),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
        ),
        (
            {"stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ],
)
def test_nested_fields_are_checked_and_named_by_their_path(fields: dict[str, Any], param: str) -> None:
    for parse, body in (
        (parse_completion_request, {"prompt": "x"}),
        (parse_chat_request, {"messages": [{"role": "user", "content": "x"}]}),
    ):
        with pytest.raises(APIError) as caught:
            parse({**body, **fields})
        assert (caught.value.status, caught.value.param) == (400, param)
        assert param in caught.value.message


def test_known_nested_fields_are_accepted() -> None:
    spec = {"name": "x", "description": "a report", "schema": SCHEMA, "strict": False}
    formats: list[Any] = [
        {"type": "json_schema", "json_schema": spec},
        {"type": "json_schema", "json_schema": {"schema": SCHEMA, "name": None, "description": None, "strict": None}},
        {"type": "json_object"},
        {"type": "text"},
        {
            "type": "structural_tag",
            "structures": [{"begin": "<a>", "schema": SCHEMA, "end": "</a>"}],
            "triggers": ["<a>"],
        },
        {"type": "structural_tag", "format": {"type": "any_text"}},
    ]
    for response_format in formats:
        parse_completion_request({"prompt": "x", "response_format": response_format})
    request = parse_completion_request({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert request.sampling.include_usage


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            "messages[0].content[0].cache_control",
        ),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages[0].content[0].type",
        ),
        ({"role": "user", "content": [{"text": "hi"}]}, "messages[0].content[0].type"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content[0].text"),
        ({"role": "user", "content": "x", "colour": "blue"}, "messages[0].colour"),
        ({"role": "user", "content": "x", "colour": None}, "messages[0].colour"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
        ({"role": "system", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
        ({"role": "user", "content": "x", "reasoning_content": "r"}, "messages[0].reasoning_content"),
        ({"role": "tool", "content": "x", "reasoning_content": "r"}, "messages[0].reasoning_content"),
        ({"role": "user", "content": "x", "name": {"a": 1}}, "messages[0].name"),
        ({"role": "tool", "content": "x", "tool_call_id": 5}, "messages[0].tool_call_id"),
        ({"role": "assistant", "content": "x", "reasoning_content": {"x": 1}}, "messages[0].reasoning_content"),
        ({"role": "assistant", "content": "x", "refusal": "I cannot"}, "messages[0].refusal"),
        # (as OpenAI's API: these roles' content, and a tool result's call id, are required)
        ({"role": "user"}, "messages[0].content"),
        ({"role": "system", "content": None}, "messages[0].content"),
        ({"role": "developer", "name": "x"}, "messages[0].content"),
        ({"role": "tool", "tool_call_id": "c1"}, "messages[0].content"),
        ({"role": "tool", "content": "20 C"}, "messages[0].tool_call_id"),
    ],
)
def test_message_fields_are_checked_by_role_and_named_by_their_path(message: dict[str, Any], param: str) -> None:
    for parse in (parse_chat_request, parse_tokenize_request):
        with pytest.raises(APIError) as caught:
            parse({"messages": [message]})
        assert (caught.value.status, caught.value.param) == (400, param)
        assert param in caught.value.message


def test_each_role_takes_its_own_fields() -> None:
    messages = [
        {"role": "system", "content": "Be brief.", "name": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ana", "tool_call_id": None},
        {"role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": [], "refusal": None},
        {"role": "tool", "content": "20 C", "tool_call_id": "c1", "name": "get_weather"},
        {"role": "ipython", "content": "a template's own role"},
    ]
    assert len(parse_chat_request({"messages": messages}).messages) == 5


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_object"},
            "guided_regex": ".",
        },
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"},
    ],
)
def test_bad_chat_bodies(body: dict[str, Any]) -> None:
    with pytest.raises(APIError) as caught:
        parse_chat_request(body)
    assert caught.value.status == 400


def test_tokenize_bodies() -> None:
    assert parse_tokenize_request({"prompt": "x"}).add_special_tokens
    chat = parse_tokenize_request({"messages": [{"role": "user", "content": "x"}]})
    assert chat.messages is not None
    assert not chat.add_special_tokens
    with pytest.raises(APIError):
        parse_tokenize_request({})
    assert parse_detokenize_request({"tokens": [1, 2]}).tokens == [1, 2]
    with pytest.raises(APIError):
        parse_detokenize_request({"tokens": ["a"]})


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (WouldBlock("full"), 429),
        (InvalidRequestError("bad"), 400),
        (ManagerClosedError("stopped"), 503),
        (EngineDeadError("dead"), 500),
        (RuntimeError("bug"), 500),
    ],
)
def test_error_mapping(exc: Exception, status: int) -> None:
    error = error_from_exception(exc)
    assert error.status == status
    assert set(error.to_dict()["error"]) == {"message", "type", "param", "code"}


def test_events_stay_on_one_line_for_any_line_splitter() -> None:
    from aiocb.server.sse import event

    text = "a\u2028b\x85c\u2029d\ne\rf"
    raw = event({"text": text}).decode()
    assert raw.startswith("data: ")
    assert raw.endswith("\n\n")
    line = raw[len("data: ") : -2]
    assert line.splitlines() == [line]
    assert json.loads(line) == {"text": text}


def test_best_of_equal_to_n_is_accepted() -> None:
    assert parse_completion_request({"prompt": "x", "best_of": 2, "n": 2}).sampling.n == 2
    assert parse_completion_request({"prompt": "x", "best_of": 1}).sampling.n == 1


@pytest.mark.parametrize(("last", "message"), [(True, "ints"), (1.5, "ints"), ("7", "ints"), (-1, "negative")])
def test_a_long_token_id_prompt_is_checked_to_its_end(last: Any, message: str) -> None:
    """The ids are checked a slice at a time: what is wrong past the first slice is found."""
    ids = [5] * 100_000
    assert parse_completion_request({"prompt": ids}).prompts == [ids]
    with pytest.raises(APIError, match=message) as caught:
        parse_completion_request({"prompt": [*ids, last]})
    assert caught.value.param == "prompt"
