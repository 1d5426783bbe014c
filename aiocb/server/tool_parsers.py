"""Tool calls found in a model's output text, as it streams.

Each parser reads one choice's text incrementally (:meth:`ToolCallParser.feed`, then
:meth:`ToolCallParser.finish`) and returns :class:`Content` and :class:`ToolCall`
fragments. Text that may still become a call is held back until it is decided, so a
stream never shows the start of a call as content. A call that does not parse, or names
a function the request did not offer, stays content: the client sees what the model
wrote rather than a call it cannot make. An output of calls alone (``tool_choice``
required or a named function, which its grammar enforces) has no content: a call cut
short at the end by ``max_tokens`` is a call with the arguments written so far, as
OpenAI returns one, or nothing where even its name was cut; one a stop string cut is
dropped.

Formats:

- ``hermes`` (Hermes, Qwen 2.5 / 3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
- ``llama3_json`` (Llama 3.1 / 3.2): ``{"name": ..., "parameters": {...}}``, calls separated by ``;``
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, and the newer
  ``[TOOL_CALLS]name[ARGS]{...}``
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any, ClassVar

from aiocb.server.fragments import Content, Fragment, HiddenTexts, ToolCall, partial_suffix


class ToolCallParser(ABC):
    """Finds one format's tool calls in a stream of text (one parser per choice)."""

    #: the name ``--tool-call-parser`` takes
    name: ClassVar[str]
    #: the marker that begins a call
    start: ClassVar[str]
    #: how xgrammar enforces the format: a builtin format name, or a single-call format
    #: for :func:`aiocb.server.tools.structural_tag`
    xgrammar_format: ClassVar[str | dict[str, str]]
    #: what goes between two calls in an output of calls alone (``tool_choice`` required)
    separator: ClassVar[str] = "\n"
    #: whether the marker is a special token, so the text must keep special tokens
    needs_special_tokens: ClassVar[bool] = False

    def __init__(
        self,
        functions: Collection[str],
        *,
        parallel: bool = True,
        hidden: Collection[str] = (),
        calls_only: bool = False,
        forced: str | None = None,
    ) -> None:
        self.functions = frozenset(functions)
        self.parallel = parallel
        #: whether the output is calls alone (no content; see the module's docstring)
        self.calls_only = calls_only or forced is not None
        #: the function ``tool_choice`` names (its call is the output), if it names one
        self.forced = forced
        #: texts of special tokens that are not content (``</s>``) when they are kept
        self._hidden = HiddenTexts([t for t in hidden if t != self.start])
        #: whether the marker is such a token too: left out of a call that stays content
        self._hides_start = self.start in hidden
        self.calls = 0
        self._buffer = ""
        self._in_call = False
        #: whitespace after content, held until more content follows (not before a call) ...
        self._space = ""
        #: ... and before what may be a call, held until that is decided (content if not)
        self._before_call = ""

    def feed(self, text: str) -> list[Fragment]:
        """The fragments ``text`` completes."""
        self._buffer += self._hidden.feed(text)
        out: list[Fragment] = []
        while True:
            if self._in_call:
                end = self._call_end(self._buffer)
                if end is None:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end:]
                self._in_call = False
                out += self._calls(body)
                continue
            at = self._buffer.find(self.start)
            if at >= 0:
                self._content(self._buffer[:at], out, before_call=True)
                self._buffer = self._buffer[at:]
                self._in_call = True
                continue
            keep = partial_suffix(self._buffer, self.start)
            self._content(self._buffer[: len(self._buffer) - keep], out, before_call=False)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        return out

    def finish(self, *, cut: bool = False) -> list[Fragment]:
        """What is left at the end of the output: an unclosed call is tried as it is
        (``cut``: the output ended at its length limit, see :func:`_cut_short`); a named
        function's call cut before its arguments is that function's, with none written."""
        self._buffer += self._hidden.finish()
        out: list[Fragment] = []
        if self._in_call:
            out += self._calls(self._buffer, cut=cut)
        else:
            self._content(self._buffer, out, before_call=False)
        self._buffer = ""
        if self._space and not self.calls and not self.calls_only:
            out.append(Content(self._space))
        self._space = ""
        if cut and self.forced is not None and not self.calls:  # (as OpenAI's: its name is not the model's)
            out.append(ToolCall(self.calls, f"call_{uuid.uuid4().hex[:24]}", self.forced, ""))
            self.calls += 1
        return out

    def _content(self, text: str, out: list[Fragment], *, before_call: bool) -> None:
        text = self._space + text
        stripped = text.rstrip()
        self._space, self._before_call = ("", text[len(stripped) :]) if before_call else (text[len(stripped) :], "")
        if stripped and not self.calls_only:
            out.append(Content(stripped))

    def _calls(self, body: str, *, cut: bool = False) -> list[Fragment]:
        """The calls in one call's text (``cut``: the output's last, cut short by its length
        limit), or that text as content when it is not calls."""
        parsed = self.parse(body)
        if parsed is None and cut and self.calls_only:
            parsed = _cut_short(body)
        space, self._before_call = self._before_call, ""
        if parsed is None or not parsed or any(name not in self.functions for name, _ in parsed):
            if self.calls_only:
                return []
            if self._hides_start:  # (the client asked for no special tokens in the text)
                body = body.replace(self.start, "")
            if body.strip():
                return [Content(space + body)]
            self._space = space + body
            return []
        if not self.parallel:
            parsed = parsed[: max(0, 1 - self.calls)]
        calls: list[Fragment] = []
        for name, arguments in parsed:
            calls.append(ToolCall(self.calls, f"call_{uuid.uuid4().hex[:24]}", name, arguments))
            self.calls += 1
        return calls

    @abstractmethod
    def _call_end(self, text: str) -> int | None:
        """Where the call that ``text`` begins with ends (None: not yet)."""

    @abstractmethod
    def parse(self, body: str) -> list[tuple[str, str]] | None:
        """``(name, arguments JSON)`` of each call in one call's text; None if it is not one."""


def _arguments(value: Any) -> str | None:
    """A call's arguments as JSON text (given as an object, or as JSON text of one)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


#: a call's name and where its arguments begin, in every format's JSON form
_CALL_HEAD = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _cut_short(body: str) -> list[tuple[str, str]]:
    """The first call a text cut short holds (an enforced format writes one call a marker):
    its name and its arguments as far as they were written (JSON when they were complete,
    only the call's closing markup cut); none where the text stops before its arguments."""
    head = _CALL_HEAD.search(body)
    if head is None:
        return []
    try:
        name = json.loads(head.group(1))
    except ValueError:  # (an invalid escape in the name: no call to make)
        return []
    end = _json_end(body, head.end())
    return [(name, body[head.end() : end].rstrip())]


def _named(value: Any, arguments_key: str) -> tuple[str, str] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = _arguments(value.get(arguments_key, {}))
    return None if arguments is None else (value["name"], arguments)


def _json_end(text: str, start: int) -> int | None:
    """The end of the JSON value at ``start`` (None while it is incomplete or invalid)."""
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None
    return int(end)


def _inside_string(text: str, start: int, at: int) -> bool:
    """Whether position ``at`` of ``text`` is inside a JSON string that begins after ``start``."""
    inside = escaped = False
    for char in text[start:at]:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = inside
        elif char == '"':
            inside = not inside
    return inside


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen)."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    xgrammar_format = "qwen_3"

    def _call_end(self, text: str) -> int | None:
        # (a closing tag inside one of the call's JSON strings is an argument's text, which
        # an enforced call's grammar allows: the call ends at the first one outside them)
        at = text.find(self.end)
        while at >= 0 and _inside_string(text, len(self.start), at):
            at = text.find(self.end, at + 1)
        return None if at < 0 else at + len(self.end)

    def parse(self, body: str) -> list[tuple[str, str]] | None:
        inner = body.removeprefix(self.start).removesuffix(self.end).strip()
        try:
            value = json.loads(inner)
        except ValueError:
            return None
        call = _named(value, "arguments")
        return None if call is None else [call]


class Llama3JsonParser(ToolCallParser):
    """``{"name": ..., "parameters": {...}}`` objects, separated by ``;`` (Llama 3.1 / 3.2)."""

    name = "llama3_json"
    start = '{"name":'
    xgrammar_format = "llama"
    separator = "; "

    def _call_end(self, text: str) -> int | None:
        end = _json_end(text, 0)
        if end is None:
            return None
        # The separator between calls belongs to the call before it: wait to see whether
        # one follows (the end of the output settles it too, in finish()).
        trimmed = text[end:].lstrip()
        if not trimmed:
            return None
        return len(text) - len(trimmed) + 1 if trimmed.startswith(";") else end

    def parse(self, body: str) -> list[tuple[str, str]] | None:
        try:
            value = json.loads(body.strip().removesuffix(";"))
        except ValueError:
            return None
        key = "parameters" if isinstance(value, dict) and "parameters" in value else "arguments"
        call = _named(value, key)
        return None if call is None else [call]


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``, or ``[TOOL_CALLS]name[ARGS]{...}``."""

    name = "mistral"
    start = "[TOOL_CALLS]"
    args = "[ARGS]"
    xgrammar_format: ClassVar[str | dict[str, str]] = {
        "begin": '[TOOL_CALLS][{"name": "',
        "name_end": '", "arguments": ',
        "end": "}]",
        "trigger": start,
    }
    needs_special_tokens = True

    def _call_end(self, text: str) -> int | None:
        body = len(self.start)
        rest = text[body:].lstrip()
        offset = len(text) - len(rest)
        if rest.startswith("["):
            return _json_end(text, offset)
        marker = rest.find(self.args)
        brace = rest.find("{")
        if marker >= 0:
            return _json_end(text, offset + marker + len(self.args))
        if brace > 0:
            return _json_end(text, offset + brace)
        return None

    def parse(self, body: str) -> list[tuple[str, str]] | None:
        rest = body.removeprefix(self.start).strip()
        if rest.startswith("["):
            try:
                values = json.loads(rest)
            except ValueError:
                return None
            if not isinstance(values, list):
                return None
            calls = [_named(value, "arguments") for value in values]
            return None if any(call is None for call in calls) else [c for c in calls if c is not None]
        name, marker, arguments = rest.partition(self.args)
        if not marker:
            brace = rest.find("{")
            name, arguments = rest[:brace], rest[brace:]
        parsed = _arguments(arguments.strip())
        name = name.strip()
        return None if parsed is None or not name else [(name, parsed)]


PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)
}


def detect_parser(chat_template: str | None) -> type[ToolCallParser] | None:
    """The parser whose format a chat template writes tool calls in (None: none found)."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HermesParser
    if "[TOOL_CALLS]" in chat_template:
        return MistralParser
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return Llama3JsonParser
    return None
