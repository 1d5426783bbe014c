"""Tool-call parsers and the reasoning splitter on text alone: every format, every way the
text may be cut into stream deltas, and what stays content."""

from __future__ import annotations

import json
import random
import re
from unittest.mock import ANY

import pytest

from aiocb.server.chat_output import ChoiceOutput, MessageBuilder, delta
from aiocb.server.fragments import Content, Fragment, HiddenTexts, Reasoning, ToolArguments, ToolCall
from aiocb.server.reasoning import ReasoningSplitter, prompt_opens_thinking
from aiocb.server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolCallParser,
    detect_parser,
)

FUNCTIONS = ("get_weather", "add")


def _run(output: ChoiceOutput, pieces: list[str], *, cut: bool = False) -> list[Fragment]:
    fragments: list[Fragment] = []
    for piece in pieces:
        fragments += output.feed(piece)
    return fragments + output.finish(cut=cut)


def _cuts(text: str, rng: random.Random) -> list[str]:
    """``text`` cut at random places (pieces of 1 to 6 characters), as a stream delivers it."""
    pieces, at = [], 0
    while at < len(text):
        size = rng.randint(1, 6)
        pieces.append(text[at : at + size])
        at += size
    return pieces


def _calls(fragments: list[Fragment]) -> list[tuple[str, str]]:
    """Each call's name and arguments, its fragments gathered as a response's message is."""
    message = MessageBuilder(reasoning=False)
    message.add(fragments)
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.message().get("tool_calls", [])]


def _summary(fragments: list[Fragment]) -> tuple[str, str, list[tuple[str, dict[str, object]]]]:
    """(content, reasoning, calls) with call ids left out (they are fresh per parse)."""
    content = "".join(f.text for f in fragments if isinstance(f, Content))
    reasoning = "".join(f.text for f in fragments if isinstance(f, Reasoning))
    return content, reasoning, [(name, json.loads(arguments)) for name, arguments in _calls(fragments)]


def _parse_every_way(
    parser: type[ToolCallParser], text: str, *, reasoning: bool = False, starts_inside: bool = False
) -> tuple[str, str, list[tuple[str, dict[str, object]]]]:
    """The parse of ``text`` whole, checked equal to its parse in 30 random cuttings."""

    def output() -> ChoiceOutput:
        splitter = ReasoningSplitter(starts_inside=starts_inside) if reasoning else None
        return ChoiceOutput(splitter, parser(FUNCTIONS))

    whole = _summary(_run(output(), [text]))
    rng = random.Random(0)
    for _ in range(30):
        assert _summary(_run(output(), _cuts(text, rng))) == whole
    return whole


def test_hermes_calls_between_content() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    )
    content, _, calls = _parse_every_way(HermesParser, text)
    assert content == "Let me check."
    assert calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


def test_hermes_leaves_what_is_not_a_call_as_content() -> None:
    plain = "a < b and <tool but not a call"
    assert _parse_every_way(HermesParser, plain) == (plain, "", [])
    unknown = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert _parse_every_way(HermesParser, unknown) == (unknown, "", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert _parse_every_way(HermesParser, broken) == (broken, "", [])
    # An output cut short inside a call: what parses is a call, the rest content.
    unclosed = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}'
    assert _parse_every_way(HermesParser, unclosed)[2] == [("add", {"a": 1})]
    assert _parse_every_way(HermesParser, '<tool_call>\n{"name": "add", "argu')[2] == []


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (HermesParser, 'Use the tag like this: <tool_call>{"name": "unknown", "arguments": {}}</tool_call> ok'),
        (HermesParser, "Compare a\n\n<tool_call>not json</tool_call>"),
        (Llama3JsonParser, 'Example: {"name": "Bob", "age": 3}'),
    ],
)
def test_what_is_not_a_call_keeps_the_space_before_it(parser: type[ToolCallParser], text: str) -> None:
    """The whitespace before a would-be call is held until the call is decided, not dropped."""
    assert _parse_every_way(parser, text) == (text, "", [])


def test_a_hermes_closing_tag_inside_an_argument_is_the_argument_s_text() -> None:
    """An enforced call's grammar lets a string argument hold the closing tag: the call
    ends at the first one outside its strings (it ended at the first, and the call was lost)."""
    arguments = {"q": 'a "quoted" </tool_call> and \\ then </tool_call>'}
    text = f"<tool_call>\n{json.dumps({'name': 'add', 'arguments': arguments})}\n</tool_call>\nafter"
    content, _, calls = _parse_every_way(HermesParser, text)
    assert calls == [("add", arguments)] and content.strip() == "after"
    forced = ChoiceOutput(None, HermesParser(FUNCTIONS, forced="add"))
    assert _summary(_run(forced, [text.removesuffix("\nafter")]))[2] == [("add", arguments)]


def test_hermes_arguments_as_json_text() -> None:
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>'
    assert _parse_every_way(HermesParser, text)[2] == [("add", {"a": 5})]


def test_llama3_json_calls() -> None:
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    content, _, calls = _parse_every_way(Llama3JsonParser, text)
    assert content == ""
    assert calls == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    plain = 'The JSON {"a": 1} is not a call.'
    assert _parse_every_way(Llama3JsonParser, plain) == (plain, "", [])


def test_mistral_both_formats_and_hidden_special_tokens() -> None:
    text = (
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    )
    assert _parse_every_way(MistralParser, text)[2] == [("add", {"a": 1}), ("get_weather", {"city": "Rome"})]
    newer = '[TOOL_CALLS]add[ARGS]{"a": 3}[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}'
    assert _parse_every_way(MistralParser, newer)[2] == [("add", {"a": 3}), ("get_weather", {"city": "Lima"})]
    # The text keeps special tokens for this format; the end-of-sequence one is not content.
    parser = MistralParser(FUNCTIONS, hidden=["</s>", "[TOOL_CALLS]"])
    fragments = _run(ChoiceOutput(None, parser), ["Sure.</s>"])
    assert _summary(fragments) == ("Sure.", "", [])
    # ... however the text comes in pieces (a held-back stop string's prefix splits it);
    # text that only looked like its start is content after all.
    for pieces in (["Sure.</", "s>"], ["Sure.<", "/", "s", ">"], ["a </", "b"], ["a </s"]):
        parser = MistralParser(FUNCTIONS, hidden=["</s>", "[TOOL_CALLS]"])
        expected = "".join(pieces).replace("</s>", "")
        assert _summary(_run(ChoiceOutput(None, parser), pieces)) == (expected, "", [])
    # A call that does not parse stays content, without the hidden marker's text.
    parser = MistralParser(FUNCTIONS, hidden=["</s>", "[TOOL_CALLS]"])
    assert _summary(_run(ChoiceOutput(None, parser), ["[TOOL_CALLS]", "[{oops}]"])) == ("[{oops}]", "", [])
    kept = MistralParser(FUNCTIONS, hidden=["</s>"])  # (the client kept special tokens)
    assert _summary(_run(ChoiceOutput(None, kept), ["[TOOL_CALLS][{oops}]"]))[0] == "[TOOL_CALLS][{oops}]"
    # The reasoning, which the parser never sees, loses them too, however it comes.
    hidden = ["</s>", "[TOOL_CALLS]"]
    for pieces in (["Hm</s>.</think>Sure."], ["Hm</", "s>.</", "think>Sure.</s>"], ["Hm </", "think>Sure."]):
        output = ChoiceOutput(ReasoningSplitter(starts_inside=True), MistralParser(FUNCTIONS, hidden=hidden), hidden)
        thought = "".join(pieces).split("</think>")[0].replace("</s>", "")
        assert _summary(_run(output, pieces)) == ("Sure.", thought, [])
    output = ChoiceOutput(ReasoningSplitter(starts_inside=True), MistralParser(FUNCTIONS, hidden=hidden), hidden)
    assert _summary(_run(output, ["Hm [TOOL_CALLS]</", "s"])) == ("", "Hm </s", [])  # (cut short: all reasoning)


def test_hidden_texts_are_left_out_however_the_text_comes() -> None:
    """Hundreds of special tokens (Mistral's control tokens), some the beginning of others:
    each is left out wherever it is split, the longest where several begin, and text that
    only looked like one's beginning comes out as it was."""
    texts = ["</s>", "[INST]", "[INST_END]", *(f"[control_{i}]" for i in range(768))]
    words = ["a", " [", "[INST", "</", "s", ">", "b [cont", "rol_7]", "c", "[control_767]", "[INST_END]", "<x>"]
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        expected = re.sub("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)), "", text)
        hidden = HiddenTexts(texts)
        assert "".join(hidden.feed(piece) for piece in _cuts(text, rng)) + hidden.finish() == expected, text


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    call = '<tool_call>{"name": "add", "arguments": {"a": %d}}</tool_call>'
    text = call % 1 + call % 2
    fragments = _run(ChoiceOutput(None, HermesParser(FUNCTIONS, parallel=False)), [text])
    assert _summary(fragments)[2] == [("add", {"a": 1})]


@pytest.mark.parametrize(
    ("text", "starts_inside", "expected"),
    [
        ("<think>Two and two.</think>\n\nFour.", False, ("Four.", "Two and two.")),
        ("Two and two.</think>\n\nFour.", True, ("Four.", "Two and two.")),  # the template opened it
        ("Four, without thinking.", False, ("Four, without thinking.", "")),
        ("<think>Still thinking when cut", False, ("", "Still thinking when cut")),
        ("  <thin and not a tag", False, ("  <thin and not a tag", "")),
    ],
)
def test_reasoning_split(text: str, starts_inside: bool, expected: tuple[str, str]) -> None:
    content, reasoning, _ = _parse_every_way(HermesParser, text, reasoning=True, starts_inside=starts_inside)
    assert (content, reasoning) == expected


def test_reasoning_then_a_tool_call() -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call>'
    text = "<think>I need the weather.</think>\n" + call
    assert _parse_every_way(HermesParser, text, reasoning=True) == (
        "",
        "I need the weather.",
        [("get_weather", {"city": "Nice"})],
    )


def test_prompt_opens_thinking() -> None:
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
    # A user's message that mentions the tag opens nothing.
    assert not prompt_opens_thinking("<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n")
    # A continued assistant message that opened the block and left it open does.
    continued = "<think>Let me see"
    assert prompt_opens_thinking(f"<|im_start|>assistant\n{continued}", continued)
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>a</think>b", "<think>a</think>b")


def test_stream_deltas_reassemble_to_the_message() -> None:
    text = 'Hi.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    fragments = _run(ChoiceOutput(None, HermesParser(FUNCTIONS)), _cuts(text, random.Random(1)))
    builder = MessageBuilder(reasoning=False)
    builder.add(fragments)
    message = builder.message()
    deltas = [delta(f) for f in fragments]
    assert "".join(d.get("content", "") for d in deltas) == message["content"] == "Hi."
    calls: list[dict[str, object]] = []
    for part in [c for d in deltas for c in d.get("tool_calls", [])]:  # (as a client gathers them)
        if "id" in part:
            calls.append({k: v for k, v in part.items() if k != "index"} | {"function": dict(part["function"])})
        else:
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    assert calls == message["tool_calls"]
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    only_calls = MessageBuilder(reasoning=True)
    only_calls.add([f for f in fragments if isinstance(f, ToolCall)])
    assert only_calls.message()["content"] is None
    assert only_calls.message()["reasoning_content"] is None


def test_auto_detects_the_parser_of_a_tokenizers_named_tool_use_template() -> None:
    """transformers renders a request's tools with a tokenizer's ``tool_use`` template."""
    from aiocb.server.app import resolve_tool_parser

    named = {"default": "{{ messages }}", "tool_use": "{{ '<tool_call>' }}"}
    assert resolve_tool_parser("auto", named) is HermesParser
    assert resolve_tool_parser("auto", {"default": "[TOOL_CALLS] {{ tools }}"}) is MistralParser
    assert resolve_tool_parser("auto", {"default": "{{ messages }}"}) is None
    assert resolve_tool_parser("auto", None) is None


def test_detect_parser() -> None:
    assert detect_parser("{{ '<tool_call>' }}") is HermesParser
    assert detect_parser("[TOOL_CALLS] {{ tools }}") is MistralParser
    assert detect_parser("<|python_tag|>{{ x }}") is Llama3JsonParser
    assert detect_parser("{{ messages }}") is None
    assert detect_parser(None) is None


#: one call to get_weather in each parser's format
ONE_CALL = {
    HermesParser: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    Llama3JsonParser: '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    MistralParser: '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
}


@pytest.mark.parametrize("parser", list(ONE_CALL))
def test_an_output_of_calls_alone_has_no_content_and_its_cut_call_keeps_what_was_written(
    parser: type[ToolCallParser],
) -> None:
    """``tool_choice`` required or a named function: the last call cut short by
    ``max_tokens`` or a stop string is a call with the arguments written so far (whole, when
    only its closing markup was cut); cut before its name, nothing; never the call's text
    as content."""
    call = ONE_CALL[parser]
    cut = call[: call.index("Paris")]  # (inside the arguments)
    rng = random.Random(3)

    def calls_of(text: str, *, length: bool = True) -> list[tuple[str, str]]:
        fragments = _run(ChoiceOutput(None, parser(FUNCTIONS, calls_only=True)), _cuts(text, rng), cut=length)
        assert not any(isinstance(f, Content) for f in fragments)
        return _calls(fragments)

    for _ in range(5):
        first, second = calls_of(call + parser.separator + cut)
        assert first[0] == "get_weather" and json.loads(first[1]) == {"city": "Paris"}
        assert second == ("get_weather", '{"city": "')
        assert calls_of(call[: call.index("get_we")]) == []  # (its name cut short)
        assert calls_of(cut, length=False) == [("get_weather", '{"city": "')]  # (a stop string ended it)
        ((name, arguments),) = calls_of(call[: call.index("}") + 1])  # (its closing markup cut)
        assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    # A named function's call cut before its arguments (or its marker) is that function's,
    # with no arguments written, as OpenAI's; not when a stop string cut it.
    for text in (call[: call.index("get_we")], call[:1], ""):
        fragments = _run(ChoiceOutput(None, parser(FUNCTIONS, forced="get_weather")), _cuts(text, rng), cut=True)
        assert _calls(fragments) == [("get_weather", "")]
        assert not any(isinstance(f, Content) for f in fragments)
    forced = _run(ChoiceOutput(None, parser(FUNCTIONS, forced="get_weather")), [call[:5]], cut=False)
    assert not any(isinstance(f, ToolCall | Content) for f in forced)
    # Where text beside calls is allowed, a call cut short is a call too, once its head was written.
    assert _run(ChoiceOutput(None, parser(FUNCTIONS)), [cut]) == [ToolCall(0, ANY, "get_weather", '{"city": "')]
    message = MessageBuilder(reasoning=False, calls_only=True)
    message.add(_run(ChoiceOutput(None, parser(FUNCTIONS, calls_only=True)), [call[:5]]))
    assert message.message() == {"role": "assistant", "content": None}


@pytest.mark.parametrize("parser", list(ONE_CALL))
def test_a_call_s_arguments_stream_as_they_are_written(parser: type[ToolCallParser]) -> None:
    """Once the head (an offered function's name, then its arguments' brace) is written, the
    call begins and its arguments come with each piece of text, before the call's end."""
    call = ONE_CALL[parser]
    output = ChoiceOutput(None, parser(FUNCTIONS))
    head_end = call.index('{"city"') + 1
    assert output.feed(call[: head_end - 1]) == []  # (no brace yet: not decided)
    (head,) = output.feed(call[head_end - 1 : head_end])
    assert isinstance(head, ToolCall) and (head.index, head.name, head.arguments) == (0, "get_weather", "{")
    grown = [output.feed(char) for char in '"city": "Par']
    assert grown == [[ToolArguments(0, char)] for char in '"city": "Par']
    rest = output.feed(call[call.index("Par") + 3 :]) + output.finish()
    assert _calls([head, *(f for pieces in grown for f in pieces), *rest]) == [("get_weather", '{"city": "Paris"}')]


def test_mistral_s_list_streams_each_call_and_stops_at_the_first_without_parallel() -> None:
    text = (
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": [1, {"b": "}]"}]}}, {"name": "get_weather", "arguments": {}}]'
    )
    output = ChoiceOutput(None, MistralParser(FUNCTIONS))
    fragments = [f for char in text for f in output.feed(char)] + output.finish()
    heads = [f for f in fragments if isinstance(f, ToolCall)]
    assert [(h.index, h.name) for h in heads] == [(0, "add"), (1, "get_weather")]
    assert _calls(fragments) == [("add", '{"a": [1, {"b": "}]"}]}'), ("get_weather", "{}")]
    single = ChoiceOutput(None, MistralParser(FUNCTIONS, parallel=False))
    assert _calls(single.feed(text) + single.finish()) == [("add", '{"a": [1, {"b": "}]"}]}')]


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        # what follows a decided call's arguments inside it is no part of them
        ('<tool_call>{"name": "add", "arguments": {"a": 1}, oops</tool_call>', [("add", '{"a": 1}')]),
        # a closing tag before the arguments end: the call keeps what was written
        ('<tool_call>{"name": "add", "arguments": {"a": </tool_call>', [("add", '{"a": ')]),
        # a head written otherwise is decided at the call's end, as a whole call
        ('<tool_call>{"arguments": {"a": 2}, "name": "add"}</tool_call>', [("add", '{"a": 2}')]),
        ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>', [("add", '{"a": 3}')]),
        # no second call where calls are not parallel
        ('<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name": "add", "arguments": {}}', []),
    ],
)
def test_hermes_calls_decided_by_their_head_or_at_their_end(text: str, calls: list[tuple[str, str]]) -> None:
    rng = random.Random(5)
    parallel = bool(calls)
    for pieces in ([text], list(text), _cuts(text, rng)):
        output = ChoiceOutput(None, HermesParser(FUNCTIONS, parallel=parallel))
        fragments = _run(output, pieces)
        assert _calls(fragments) == (calls or [("add", "{}")])
        assert not any(isinstance(f, Content) for f in fragments)


def test_mistral_s_brace_form_before_an_args_form_call_is_read_however_split() -> None:
    """The ``[ARGS]`` of a later call is not this one's (read whole, the first call's end was
    looked for after it, and both calls were content)."""
    text = '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1}'
    assert _parse_every_way(MistralParser, text) == ("", "", [("get_weather", {"city": "Paris"}), ("add", {"a": 1})])


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (Llama3JsonParser, '{"name": "add", "parameters": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"),
        (MistralParser, '[TOOL_CALLS][{"name": "add", "arguments": "' + "[" * 5000 + '"}]'),
        (HermesParser, '<tool_call>{"name": "add", "arguments": "{\\"a\\": ' + "[" * 5000 + '"}</tool_call>'),
        (Llama3JsonParser, 'Here: {"name": ' + "[" * 5000),
    ],
)
def test_json_nested_past_the_decoder_s_depth_is_no_error(parser: type[ToolCallParser], text: str) -> None:
    """Nested deeper than Python's recursion limit, the decoder raised RecursionError: the
    choice failed with a 500 (its batch-mates with it)."""
    results = []
    for pieces in ([text], _cuts(text, random.Random(2))):
        fragments = _run(ChoiceOutput(None, parser(FUNCTIONS)), pieces)
        content = "".join(f.text for f in fragments if isinstance(f, Content))
        results.append((content, _calls(fragments)))
    assert results[0] == results[1]
    content, calls = results[0]
    # (a call its head decided keeps its arguments' text; any other text stays content)
    assert calls == [("add", text[text.index('{"a"') : -1])] if parser is Llama3JsonParser and calls else not calls
    assert content == ("" if calls else text)


def test_a_list_s_calls_after_those_decided_by_their_heads_come_whole() -> None:
    """An object of Mistral's list that gives its arguments as a string (or its name after
    them) is no head: it was dropped once an earlier object's head decided a call."""
    for second in (
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
        '{"arguments": {"city": "Paris"}, "name": "get_weather"}',
    ):
        text = f'[TOOL_CALLS][{{"name": "add", "arguments": {{"a": 1}}}}, {second}]'
        assert _parse_every_way(MistralParser, text)[2] == [("add", {"a": 1}), ("get_weather", {"city": "Paris"})]
        single = ChoiceOutput(None, MistralParser(FUNCTIONS, parallel=False))
        assert _calls(_run(single, list(text))) == [("add", '{"a": 1}')]


def test_a_hermes_call_left_unclosed_ends_where_the_next_begins_or_the_text_goes_on() -> None:
    """Without its closing tag, a call decided by its head ran to the end of the output:
    the next call, or the text after it, was lost."""
    first = '<tool_call>{"name": "add", "arguments": {"a": 1}}\n'
    second = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert _parse_every_way(HermesParser, first + second) == (
        "",
        "",
        [("add", {"a": 1}), ("get_weather", {"city": "Paris"})],
    )
    assert _parse_every_way(HermesParser, first + "I have called add.") == (
        "I have called add.",
        "",
        [("add", {"a": 1})],
    )
    # Closed, what follows its arguments inside the call is no part of anything.
    closed = '<tool_call>{"name": "add", "arguments": {"a": 1}} extra</tool_call>'
    assert _parse_every_way(HermesParser, closed) == ("", "", [("add", {"a": 1})])


def test_a_call_cut_inside_a_string_keeps_what_may_look_like_the_closing_tag() -> None:
    """Text inside an argument's string is the argument's, however it ends: the end of one
    that could begin ``</tool_call>`` was dropped when the output was cut there."""
    for written in ('{"html": "<b>a</b><', '{"html": "see </tool_call>', '{"html": "a\\'):
        output = ChoiceOutput(None, HermesParser(FUNCTIONS))
        fragments = _run(output, list(f'<tool_call>{{"name": "add", "arguments": {written}'), cut=True)
        assert _calls(fragments) == [("add", written)]
    # Outside strings, a tag's beginning at the cut is markup, not arguments.
    fragments = _run(ChoiceOutput(None, HermesParser(FUNCTIONS)), ['<tool_call>{"name": "add", "arguments": {}}</tool'])
    assert _calls(fragments) == [("add", "{}")]


def test_mistral_s_args_marker_kept_when_the_client_skips_special_tokens() -> None:
    """``[ARGS]`` is a special token the client's skipped tokens may list: hidden, no call
    was decided until its JSON closed, and one cut short became content."""
    hidden = ["</s>", "[ARGS]", "[TOOL_CALLS]"]
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'
    output = ChoiceOutput(None, MistralParser(FUNCTIONS, hidden=hidden), hidden)
    streamed = [f for char in text for f in output.feed(char)]
    assert isinstance(streamed[0], ToolCall) and streamed[0].name == "get_weather"
    assert _calls(streamed + output.finish(cut=True)) == [("get_weather", '{"city": "Pa')]
    plain = ChoiceOutput(None, MistralParser(FUNCTIONS, hidden=hidden), hidden)
    assert _run(plain, ["[TOOL_CALLS]no call[ARGS] here"]) == [Content("no call here")]


def test_a_call_s_text_is_read_once_however_long() -> None:
    """Finding a call's end rescanned or decoded its whole text on each delta (a call of
    14,000 characters, 40 closing tags inside its strings, took 290 ms a step at the end
    of 64 choices): the scan reads each delta once."""
    from aiocb.server import tool_parsers

    content = 'print("</tool_call>")\n' * 40 + "x = [1, {2: 3}]\n" * 400
    arguments = json.dumps({"path": "a.py", "content": content})
    texts = {
        HermesParser: f'<tool_call>{{"name": "add", "arguments": {arguments}}}</tool_call>',
        Llama3JsonParser: f'{{"name": "add", "parameters": {arguments}}}',
        MistralParser: f'[TOOL_CALLS][{{"name": "add", "arguments": {arguments}}}]',
    }
    searches = 0
    signs = tool_parsers._SIGNS

    class Counted:
        def search(self, *args: int | str) -> re.Match[str] | None:
            nonlocal searches
            searches += 1
            return signs.search(*args)  # type: ignore[arg-type]

    original, tool_parsers._SIGNS = tool_parsers._SIGNS, Counted()  # type: ignore[assignment]
    try:
        for parser, text in texts.items():
            searches = 0
            pieces = [text[at : at + 4] for at in range(0, len(text), 4)]
            assert _calls(_run(ChoiceOutput(None, parser(FUNCTIONS)), pieces)) == [("add", arguments)]
            marks = sum(text.count(char) for char in '"\\{}[]<')
            assert searches <= 2 * (marks + len(pieces)), (parser, searches, marks, len(pieces))
    finally:
        tool_parsers._SIGNS = original


def test_what_looks_like_a_call_but_is_no_json_ends_where_its_brackets_close() -> None:
    """Decoded whole on each delta, a would-be call that was no JSON never ended: the rest
    of the output, a call after it too, was taken for its text."""
    text = 'Like {"name": Bob} and then {"name": "add", "parameters": {"a": 1}}'
    assert _parse_every_way(Llama3JsonParser, text) == ('Like {"name": Bob} and then', "", [("add", {"a": 1})])
    listed = '[TOOL_CALLS][{"name": add}] then [TOOL_CALLS][{"name": "add", "arguments": {"a": 2}}]'
    assert _parse_every_way(MistralParser, listed) == ('[TOOL_CALLS][{"name": add}] then', "", [("add", {"a": 2})])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a nameless object right after the marker is no call: content, and reading goes on
        (
            '[TOOL_CALLS]{"x": {"y": 1}} [TOOL_CALLS]add[ARGS]{"a": 1}',
            ('[TOOL_CALLS]{"x": {"y": 1}}', "", [("add", {"a": 1})]),
        ),
        # arguments that open no bracket: content, and the next call is read
        (
            '[TOOL_CALLS]add[ARGS]5 [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
            ("[TOOL_CALLS]add[ARGS]5", "", [("get_weather", {"city": "Oslo"})]),
        ),
        # from a list's object calling no offered function on, the list is content
        (
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "rm_rf", "arguments": {}}, '
            '{"name": "add", "arguments": {"a": 2}}]',
            ('{"name": "rm_rf", "arguments": {}}, {"name": "add", "arguments": {"a": 2}}', "", [("add", {"a": 1})]),
        ),
        (  # (the space before the marker stays between the content and that object)
            'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "rm_rf", "arguments": {}}] ok',
            ('Sure. {"name": "rm_rf", "arguments": {}} ok', "", [("add", {"a": 1})]),
        ),
    ],
)
def test_mistral_s_odd_texts_read_the_same_however_split(
    text: str, expected: tuple[str, str, list[tuple[str, dict[str, object]]]]
) -> None:
    """Each read differently whole and split (a later call lost as content), or ran to the
    end of the output, or dropped an object that named a function not offered."""
    assert _parse_every_way(MistralParser, text) == expected


def test_hidden_markers_stay_out_of_the_content() -> None:
    """``[ARGS]`` is kept for the parser, never hidden from it; where the client skips
    special tokens it stays out of the content too, however split."""
    hidden = ["</s>", "[TOOL_CALLS]", "[ARGS]"]
    for text, content in (
        ("Sure [ARGS] x</s>", "Sure  x"),
        ('[TOOL_CALLS]add[ARGS]{"a": 1} then [ARGS] x', " then  x"),
    ):
        for pieces in ([text], list(text)):
            fragments = _run(ChoiceOutput(None, MistralParser(FUNCTIONS, hidden=hidden), hidden), pieces)
            assert "".join(f.text for f in fragments if isinstance(f, Content)) == content


def test_text_after_a_closed_call_object_opens_no_string() -> None:
    """After an unclosed Hermes call's object, a lone quote in the text that follows hid
    the next call's marker, as if inside a JSON string: the call came as content."""
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1}}\nI said "hi\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    assert _parse_every_way(HermesParser, text) == (
        'I said "hi',
        "",
        [("add", {"a": 1}), ("get_weather", {"city": "Oslo"})],
    )
