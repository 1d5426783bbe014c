"""Tool calls found in a model's output text, as it streams.

Each parser reads one choice's text incrementally (:meth:`ToolCallParser.feed`, then
:meth:`ToolCallParser.finish`) and returns :class:`Content` and :class:`ToolCall`
fragments. Text that may still become a call is held back until it is decided, so a
stream never shows the start of a call as content. A call is decided by its head: once
the model has written the name of a function the request offered and the opening brace
of its arguments, it is a call, and its arguments stream as the model writes them (as
OpenAI's do: a client may show them growing), in a stream and in a whole response alike;
they are the model's text, JSON when the model wrote them whole. A call cut short (by
``max_tokens`` or a stop string) keeps the arguments written so far. A call whose head
is not written that way (its arguments given as a string, or before its name) is decided
when it ends: one that does not parse, or names a function the request did not offer,
stays content, so the client sees what the model wrote rather than a call it cannot
make. An output of calls alone (``tool_choice`` required or a named function, which its
grammar enforces) has no content: a call cut at its length limit before its arguments'
brace is that function's with the arguments so far, or nothing where even its name was
cut.

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

from aiocb.server.fragments import Content, Fragment, HiddenTexts, ToolArguments, ToolCall, partial_suffix


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
    #: the marker that ends a call, where the format has one
    end: ClassVar[str] = ""

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
        #: the call being read, once its head decided it (streaming its arguments)
        self._open: _OpenCall | None = None

    def feed(self, text: str) -> list[Fragment]:
        """The fragments ``text`` completes."""
        self._buffer += self._hidden.feed(text)
        out: list[Fragment] = []
        while True:
            if self._in_call:
                end = self._call_end(self._buffer)
                if end is None:
                    out += self._stream(self._buffer)
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

    def _stream(self, text: str) -> list[Fragment]:
        """The call that ``text`` (the buffer, from the call's marker) begins, once its head
        decides it, and then its arguments as far as ``text`` holds them (not the call's end
        marker, nor what may begin it: arguments cut short there end before it)."""
        if self.end:
            text = text.removesuffix(self.end)
            text = text[: len(text) - partial_suffix(text, self.end)]
        out: list[Fragment] = []
        while True:
            call = self._open
            if call is None:
                head = self._head(text, 0) if self.parallel or not self.calls else None
                if head is None or head[0] not in self.functions:
                    return out
                self._before_call = ""
                call = self._open = _OpenCall(self.calls, head[1])
                out.append(ToolCall(self.calls, f"call_{uuid.uuid4().hex[:24]}", head[0], ""))
                self.calls += 1
            arguments = call.read(text)
            if arguments:
                out.append(ToolArguments(call.index, arguments))
            if call.end is None or not self.parallel:
                return out
            # (a format that writes several calls after one marker: the next one's head)
            head = self._head(text, call.end)
            if head is None or head[0] not in self.functions:
                return out
            call = self._open = _OpenCall(self.calls, head[1])
            out.append(ToolCall(self.calls, f"call_{uuid.uuid4().hex[:24]}", head[0], ""))
            self.calls += 1

    def _head(self, text: str, at: int) -> tuple[str, int] | None:
        """The name of the call whose head is at ``at`` of a call's text (at 0: the first
        call's, at the end of a call's arguments: the next one's, where the format writes
        several after one marker) and where its arguments' brace is; None if not (yet) one."""
        if at:
            return None
        head = self._first_head.match(text)
        return None if head is None else _head_name(head)

    #: the first call's head (its name in group 1, quoted as a JSON string ...)
    _first_head: ClassVar[re.Pattern[str]]

    def _calls(self, body: str, *, cut: bool = False) -> list[Fragment]:
        """The calls in one call's text (``cut``: the output's last, cut short by its length
        limit), or that text as content when it is not calls."""
        streamed = self._stream(body)
        if self._open is not None:
            self._open = None
            return streamed
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
        for name, arguments in parsed:  # (a call decided as it ends comes whole)
            calls.append(ToolCall(self.calls, f"call_{uuid.uuid4().hex[:24]}", name, arguments))
            self.calls += 1
        return calls

    @abstractmethod
    def _call_end(self, text: str) -> int | None:
        """Where the call that ``text`` begins with ends (None: not yet)."""

    @abstractmethod
    def parse(self, body: str) -> list[tuple[str, str]] | None:
        """``(name, arguments JSON)`` of each call in one call's text; None if it is not one."""


class _OpenCall:
    """A call decided by its head: its index, and its arguments' text as it is read."""

    __slots__ = ("_depth", "_escaped", "_in_string", "_read", "end", "index")

    def __init__(self, index: int, start: int) -> None:
        self.index = index
        #: where the arguments end in the call's text (past their closing brace), once read
        self.end: int | None = None
        self._read = start
        self._depth = 0
        self._in_string = self._escaped = False

    def read(self, text: str) -> str:
        """The arguments' text that ``text`` (the call's, from its marker) adds."""
        start = self._read
        if self.end is not None:
            return ""
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for i in range(start, len(text)):
            char = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    self.end = self._read = i + 1
                    return text[start : i + 1]
        self._depth, self._in_string, self._escaped, self._read = depth, in_string, escaped, len(text)
        return text[start:]


#: a call's JSON object up to its arguments' brace: its name (a JSON string, group 1) first
_OBJECT_HEAD = r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'


def _head_name(head: re.Match[str]) -> tuple[str, int] | None:
    """A head's function name (its first group, a JSON string) and where its arguments'
    brace is."""
    try:
        name = json.loads(head.group(1))
    except ValueError:  # (an invalid escape: no call to make of it)
        return None
    return name, head.end() - 1


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
    _first_head = re.compile(r"<tool_call>\s*" + _OBJECT_HEAD.replace("|parameters", ""))

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
    _first_head = re.compile(_OBJECT_HEAD)

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
    _first_head = re.compile(
        r"\[TOOL_CALLS\]\s*(?:\[\s*" + _OBJECT_HEAD.replace("|parameters", "") + r"|([^\s\[{][^\[{]*?)\s*\[ARGS\]\s*\{)"
    )
    #: a call after another in the list form: the list's next object
    _next_head = re.compile(r"\s*\}\s*,\s*" + _OBJECT_HEAD.replace("|parameters", ""))

    def _head(self, text: str, at: int) -> tuple[str, int] | None:
        if not at:
            head = self._first_head.match(text)
            if head is None:
                return None
            if head.group(2) is not None:  # (name[ARGS]{...})
                return head.group(2).strip(), head.end() - 1
            return _head_name(head)
        head = self._next_head.match(text, at)
        return None if head is None else _head_name(head)

    def _call_end(self, text: str) -> int | None:
        body = len(self.start)
        rest = text[body:].lstrip()
        offset = len(text) - len(rest)
        if rest.startswith("["):
            return _json_end(text, offset)
        marker = rest.find(self.args)
        brace = rest.find("{")
        # (a marker after the brace is a later call's: this one is name{...})
        if marker >= 0 and (brace < 0 or marker < brace):
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
