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

import hashlib
import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any, ClassVar

from aiocb.server.fragments import Content, Fragment, HiddenTexts, ToolArguments, ToolCall, call_id, partial_suffix


class ToolCallParser(ABC):
    """Finds one format's tool calls in a stream of text (one parser per choice).

    A call's text is read once, as it comes (:class:`_Scan`): finding where it ends costs
    each delta its own length, whatever the call's (rescanned or decoded whole on each
    delta, a call with 14,000 characters of arguments took 2 to 290 ms a step at the end of
    64 to 256 choices)."""

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
    #: the format's markers, which a client's skipped special tokens never hide from it
    markers: ClassVar[tuple[str, ...]]
    #: the first call's head (its name in group 1, quoted as a JSON string)
    _first_head: ClassVar[re.Pattern[str]]

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
        self._hidden = HiddenTexts([t for t in hidden if t not in self.markers])
        #: the markers that are such tokens too: left out of a call that stays content, and
        #: (but the start, which begins a call) of the content
        self._hidden_markers = [marker for marker in self.markers if marker in hidden]
        self._hidden_in_content = HiddenTexts([marker for marker in self._hidden_markers if marker != self.start])
        self.calls = 0
        self._buffer = ""
        self._in_call = False
        #: whitespace after content, held until more content follows (not before a call) ...
        self._space = ""
        #: ... and before what may be a call, held until that is decided (content if not)
        self._before_call = ""
        #: the call being read, once its head decided it (streaming its arguments)
        self._open: _OpenCall | None = None
        #: the calls its head decided in the text of one marker (several in a list)
        self._decided = 0
        self._begin_scan()

    @staticmethod
    def call_id() -> str:
        """A new id for a call the model makes."""
        return call_id()

    @staticmethod
    def template_id(given: str) -> str:
        """A call id a client sent back, as the format's chat template takes it."""
        return given

    def feed(self, text: str) -> list[Fragment]:
        """The fragments ``text`` completes."""
        self._buffer += self._hidden.feed(text)
        out: list[Fragment] = []
        while True:
            if self._in_call:
                content, end = self._call_end(self._buffer)
                if end is None:
                    out += self._stream(self._buffer, content)
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end:]
                out += self._calls(body, content)
                continue
            at = self._buffer.find(self.start)
            if at >= 0:
                self._content(self._buffer[:at], out, before_call=True)
                self._buffer = self._buffer[at:]
                self._begin_call()
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
            out += self._calls(self._buffer, self._call_end(self._buffer)[0], cut=cut, closed=False)
        else:
            self._content(self._buffer, out, before_call=False, last=True)
        self._buffer = ""
        if self._space and not self.calls and not self.calls_only:
            out.append(Content(self._space))
        self._space = ""
        if cut and self.forced is not None and not self.calls:  # (as OpenAI's: its name is not the model's)
            out.append(ToolCall(self.calls, self.call_id(), self.forced, ""))
            self.calls += 1
        return out

    def _begin_call(self) -> None:
        """A call's marker begins the buffer: its text is read from here."""
        self._in_call = True
        self._decided = 0
        self._begin_scan()

    def _content(self, text: str, out: list[Fragment], *, before_call: bool, last: bool = False) -> None:
        text = self._hidden_in_content.feed(text)
        if before_call or last:
            text += self._hidden_in_content.finish()
        text = self._space + text
        stripped = text.rstrip()
        self._space, self._before_call = ("", text[len(stripped) :]) if before_call else (text[len(stripped) :], "")
        if stripped and not self.calls_only:
            out.append(Content(stripped))

    def _stream(self, text: str, limit: int) -> list[Fragment]:
        """The call that ``text`` (the buffer, from the call's marker) begins, once its head
        decides it, and then its arguments as far as ``text`` holds them before ``limit``
        (the call's closing markup, or what may begin it, is past that)."""
        out: list[Fragment] = []
        while True:
            call = self._open
            if call is None:
                head = self._head(text, 0) if self.parallel or not self.calls else None
                if head is None or head[0] not in self.functions:
                    return out
                out.append(self._decide(*head))
                call = self._open
                assert call is not None
            arguments = call.read(text, limit)
            if arguments:
                out.append(ToolArguments(call.index, arguments))
            if call.end is None or not self.parallel:
                return out
            # (a format that writes several calls after one marker: the next one's head)
            head = self._head(text, call.end)
            if head is None or head[0] not in self.functions:
                return out
            out.append(self._decide(*head))

    def _decide(self, name: str, arguments_at: int) -> ToolCall:
        """A call its head decided, whose arguments' brace is at ``arguments_at``."""
        self._open = _OpenCall(self.calls, arguments_at)
        self._decided += 1
        self.calls += 1
        return ToolCall(self.calls - 1, self.call_id(), name, "")

    def _head(self, text: str, at: int) -> tuple[str, int] | None:
        """The name of the call whose head is at ``at`` of a call's text (at 0: the first
        call's, at the end of a call's arguments: the next one's, where the format writes
        several after one marker) and where its arguments' brace is; None if not (yet) one."""
        if at:
            return None
        head = self._first_head.match(text)
        return None if head is None else _head_name(head)

    def _calls(self, body: str, content: int, *, cut: bool = False, closed: bool = True) -> list[Fragment]:
        """The calls in one call's text, whose content ends at ``content`` (``cut``: the
        output's last, cut short by its length limit; not ``closed``: the output ended in
        it), or that text as content when it is not calls."""
        self._in_call = False
        out = self._stream(body, content)
        # (the space before the marker: content, should the text turn out not to be calls)
        space, self._before_call = self._before_call, ""
        call = self._open
        if call is not None:
            self._open = None
            out += self._undecided_rest(body, call, space)
            if call.end is not None and not (closed and self._closed(body)):
                # (a call left unclosed, what follows its arguments is content: the output
                # went on, or another call began)
                tail = _CLOSING.match(body, call.end, content)
                self._content(body[tail.end() if tail else call.end : content], out, before_call=False, last=not closed)
            return out
        parsed = self.parse(body)
        if parsed is None and cut and self.calls_only:
            parsed = _cut_short(body)
        if parsed is None or not parsed or any(name not in self.functions for name, _ in parsed):
            if self.calls_only:
                return []
            for marker in self._hidden_markers:  # (the client asked for no special tokens in the text)
                body = body.replace(marker, "")
            if body.strip():
                return [Content(space + body)]
            self._space = space + body
            return []
        return self._whole(parsed)

    def _closed(self, body: str) -> bool:
        """Whether a call's text ends with the format's closing markup (where it has any)."""
        return True

    def _undecided_rest(self, body: str, last: _OpenCall, space: str) -> list[Fragment]:
        """Calls after those their heads decided in one marker's text (a list's objects
        that give their name after their arguments, or their arguments as a string), whole;
        ``space`` went before the marker."""
        return []

    def _whole(self, parsed: list[tuple[str, str]]) -> list[Fragment]:
        """Calls decided as they end: they come whole."""
        if not self.parallel:
            parsed = parsed[: max(0, 1 - self.calls)]
        calls: list[Fragment] = []
        for name, arguments in parsed:
            calls.append(ToolCall(self.calls, self.call_id(), name, arguments))
            self.calls += 1
        return calls

    @abstractmethod
    def _begin_scan(self) -> None:
        """Start reading a new call's text (the buffer begins with its marker)."""

    @abstractmethod
    def _call_end(self, text: str) -> tuple[int, int | None]:
        """How far the call that ``text`` begins with is known to be its content, and where
        the call ends (None: not yet)."""

    @abstractmethod
    def parse(self, body: str) -> list[tuple[str, str]] | None:
        """``(name, arguments JSON)`` of each call in one call's text; None if it is not one."""


#: what closes a call's JSON after its arguments (its object, a list's)
_CLOSING = re.compile(r"\s*(?:\}\s*)?(?:\]\s*)?")
#: what goes from the end of a list's object's arguments (or of an object) to the next object
_NEXT_OBJECT = re.compile(r"\s*\}?\s*,\s*(?=\{)")

#: what a JSON scan stops at: strings' quotes and escapes, brackets, a marker's ``<``
_SIGNS = re.compile(r'["\\{}\[\]<]')


class _Scan:
    """A JSON text read as it comes: whether it is inside a string (after a backslash),
    and the depth of its brackets. Each read goes on from where the last stopped."""

    __slots__ = ("at", "closed", "depth", "escaped", "in_string")

    def __init__(self, at: int) -> None:
        #: where the next read begins
        self.at = at
        self.depth = 0
        self.in_string = self.escaped = False
        #: whether a read ended where the value closed (not at a marker)
        self.closed = False

    def read(self, text: str, limit: int, *, close: bool = False, markers: tuple[str, ...] = ()) -> int | None:
        """Read ``text`` up to ``limit``: where the value the scan began at closes (``close``:
        past its last bracket), or where the first of ``markers`` (each beginning with
        ``<``) is, outside strings; None when ``limit`` came first (the scan then rests
        before what may begin a marker)."""
        i = self.at
        if self.escaped:
            if i >= limit:
                return None
            self.escaped = False
            i += 1
        while True:
            sign = _SIGNS.search(text, i, limit)
            if sign is None:
                self.at = limit
                return None
            i = sign.start()
            char = text[i]
            if self.in_string:
                if char == '"':
                    self.in_string = False
                elif char == "\\":
                    if i + 1 >= limit:
                        self.at, self.escaped = limit, True
                        return None
                    i += 1
            elif char == '"':
                self.in_string = True
            elif char == "<":
                if markers:
                    for marker in markers:
                        if text.startswith(marker, i, limit):
                            self.at = i
                            return i
                    if limit - i < max(map(len, markers)) and any(m.startswith(text[i:limit]) for m in markers):
                        self.at = i
                        return None
            elif char in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if close and self.depth == 0:
                    self.at, self.closed = i + 1, True
                    return i + 1
            i += 1


class _OpenCall:
    """A call decided by its head: its index, and its arguments' text as it is read."""

    __slots__ = ("_scan", "_sent", "end", "index")

    def __init__(self, index: int, start: int) -> None:
        self.index = index
        #: where the arguments end in the call's text (past their closing brace), once read
        self.end: int | None = None
        self._scan = _Scan(start)
        self._sent = start

    def read(self, text: str, limit: int) -> str:
        """The arguments' text that ``text`` (the call's, from its marker) adds up to ``limit``."""
        if self.end is not None:
            return ""
        self.end = self._scan.read(text, limit, close=True)
        upto = limit if self.end is None else self.end
        piece, self._sent = text[self._sent : upto], max(self._sent, upto)
        return piece


#: a call's JSON object up to its arguments' brace: its name (a JSON string, group 1) first
#: (bounded: a name that never closes is no head, and is not searched again and again)
_OBJECT_HEAD = r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.){0,256}")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'


def _head_name(head: re.Match[str]) -> tuple[str, int] | None:
    """A head's function name (its first group, a JSON string) and where its arguments'
    brace is."""
    name = _loads(head.group(1))
    return None if not isinstance(name, str) else (name, head.end() - 1)  # (an invalid escape: no call)


#: what :func:`_loads` gives for text that is not JSON
_NOT_JSON = object()


def _loads(text: str) -> Any:
    """``text`` decoded as JSON, or :data:`_NOT_JSON` (nested too deeply for the decoder too)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _arguments(value: Any) -> str | None:
    """A call's arguments as JSON text (given as an object, or as JSON text of one)."""
    if isinstance(value, str):
        value = _loads(value)
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
    name = _loads(head.group(1))
    if not isinstance(name, str):  # (an invalid escape in the name: no call to make)
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
    except (ValueError, RecursionError):
        return None
    return int(end)


class _ValueEnd:
    """Where a JSON value in a call's text ends (past its closing bracket), read as it comes
    (None while it is open). One that is no JSON ends there too: the call's text is then
    content, and what follows is read on (decoded whole on each delta, it ran to the end of
    the output)."""

    __slots__ = ("_opened", "_scan", "end")

    def __init__(self, start: int) -> None:
        self._scan = _Scan(start)
        self._opened = False
        self.end: int | None = None

    def read(self, text: str) -> int | None:
        """Where the value ends in ``text`` (the call's, from its marker), once known; a
        value that opens no bracket (``[ARGS]5``) ends the call where it begins: it is
        content, and what follows is read on."""
        if self.end is None and not self._opened:
            at = self._scan.at
            while at < len(text) and text[at].isspace():
                at += 1
            if at == len(text):
                return None
            if text[at] not in "{[":
                self.end = at
                return at
            self._opened = True
        if self.end is None:
            self.end = self._scan.read(text, len(text), close=True)
        return self.end


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen)."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    markers = (start,)
    xgrammar_format = "qwen_3"
    _first_head = re.compile(r"<tool_call>\s*" + _OBJECT_HEAD.replace("|parameters", ""))

    def _begin_scan(self) -> None:
        self._scan = _Scan(len(self.start))
        #: where the call's object closed, once it did (text after it is no JSON: its
        #: quotes open no string), and how far it was looked through for the markers since
        self._closed_at: int | None = None
        self._looked = 0

    def _call_end(self, text: str) -> tuple[int, int | None]:
        # A closing tag inside one of the call's JSON strings is an argument's text, which
        # an enforced call's grammar allows: the call ends at the first one outside them,
        # or where another call begins (this one left unclosed).
        if self._closed_at is None:
            at = self._scan.read(text, len(text), close=True, markers=(self.end, self.start))
            if at is None:
                return self._scan.at, None
            if not self._scan.closed:
                return at, at + (len(self.end) if text.startswith(self.end, at) else 0)
            self._closed_at = self._looked = at
        since = max(self._closed_at, self._looked - len(self.end) + 1)
        self._looked = len(text)
        found = [at for at in (text.find(self.end, since), text.find(self.start, since)) if at >= 0]
        if found:
            at = min(found)
            return at, at + (len(self.end) if text.startswith(self.end, at) else 0)
        held = max(partial_suffix(text, self.end), partial_suffix(text, self.start))
        return max(self._closed_at, len(text) - held), None

    def _closed(self, body: str) -> bool:
        return body.endswith(self.end)

    def parse(self, body: str) -> list[tuple[str, str]] | None:
        value = _loads(body.removeprefix(self.start).removesuffix(self.end).strip())
        call = _named(value, "arguments")
        return None if call is None else [call]


class Llama3JsonParser(ToolCallParser):
    """``{"name": ..., "parameters": {...}}`` objects, separated by ``;`` (Llama 3.1 / 3.2)."""

    name = "llama3_json"
    start = '{"name":'
    markers = (start,)
    xgrammar_format = "llama"
    separator = "; "
    _first_head = re.compile(_OBJECT_HEAD)

    def _begin_scan(self) -> None:
        self._value = _ValueEnd(0)

    def _call_end(self, text: str) -> tuple[int, int | None]:
        end = self._value.read(text)
        if end is None:
            return len(text), None
        # The separator between calls belongs to the call before it: wait to see whether
        # one follows (the end of the output settles it too, in finish()).
        after = len(text) - len(text[end:].lstrip())
        if after == len(text):
            return end, None
        return end, after + 1 if text.startswith(";", after) else end

    def parse(self, body: str) -> list[tuple[str, str]] | None:
        value = _loads(body.strip().removesuffix(";"))
        key = "parameters" if isinstance(value, dict) and "parameters" in value else "arguments"
        call = _named(value, key)
        return None if call is None else [call]


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``, or ``[TOOL_CALLS]name[ARGS]{...}``."""

    name = "mistral"
    start = "[TOOL_CALLS]"
    args = "[ARGS]"
    markers = (start, args)
    xgrammar_format: ClassVar[str | dict[str, str]] = {
        "begin": '[TOOL_CALLS][{"name": "',
        "name_end": '", "arguments": ',
        "end": "}]",
        "trigger": start,
    }
    needs_special_tokens = True
    _first_head = re.compile(
        r"\[TOOL_CALLS\]\s*(?:\[\s*"
        + _OBJECT_HEAD.replace("|parameters", "")
        + r"|([^\s\[{][^\[{]{0,255}?)\s*\[ARGS\]\s*\{)"
    )
    #: a call after another in the list form: the list's next object
    _next_head = re.compile(r"\s*\}\s*,\s*" + _OBJECT_HEAD.replace("|parameters", ""))

    def _begin_scan(self) -> None:
        self._value: _ValueEnd | None = None
        #: how far the call's text was looked through for where its JSON begins
        self._looked = len(self.start)

    def _head(self, text: str, at: int) -> tuple[str, int] | None:
        if not at:
            if self._value is None:  # (no list nor [ARGS] yet: no head either)
                return None
            head = self._first_head.match(text)
            if head is None:
                return None
            if head.group(2) is not None:  # (name[ARGS]{...})
                return head.group(2).strip(), head.end() - 1
            return _head_name(head)
        head = self._next_head.match(text, at)
        return None if head is None else _head_name(head)

    def _call_end(self, text: str) -> tuple[int, int | None]:
        if self._value is None:
            start = self._value_start(text)
            if start is None:
                return len(text), None
            self._value = _ValueEnd(start)
        end = self._value.read(text)
        return (len(text), None) if end is None else (end, end)

    def _value_start(self, text: str) -> int | None:
        """Where the call's JSON begins: its list, or its arguments (None: not yet known;
        each delta is looked through once)."""
        offset = len(self.start)
        while offset < len(text) and text[offset].isspace():
            offset += 1
        if text.startswith("[", offset):
            return offset
        since = max(offset, self._looked - len(self.args) + 1)
        self._looked = len(text)
        marker = text.find(self.args, since)
        brace = text.find("{", since)
        # (a marker after the brace is a later call's: this one is name{...})
        if marker >= 0 and (brace < 0 or marker < brace):
            return marker + len(self.args)
        return brace if brace >= offset else None

    @staticmethod
    def call_id() -> str:
        # Mistral's templates refuse any other id: nine letters and digits.
        return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))

    @staticmethod
    def template_id(given: str) -> str:
        # (an id made elsewhere, OpenAI's say, becomes nine letters and digits, the same each
        # time it is sent: a call's and its result's stay paired)
        if len(given) == 9 and given.isascii() and given.isalnum():
            return given
        number = int.from_bytes(hashlib.sha256(given.encode()).digest()[:8], "big")
        digits = []
        for _ in range(9):
            number, digit = divmod(number, len(_ID_CHARACTERS))
            digits.append(_ID_CHARACTERS[digit])
        return "".join(digits)

    def _undecided_rest(self, body: str, last: _OpenCall, space: str) -> list[Fragment]:
        if last.end is None:
            return []
        out: list[Fragment] = []
        following = _NEXT_OBJECT.match(body, last.end)  # (past the decided call's object)
        at = following.end() if following else -1
        while at >= 0:  # (each object after it, whole, up to one that is no call of an offered function)
            end = _Scan(at).read(body, len(body), close=True)
            call = None if end is None else _named(_loads(body[at:end]), "arguments")
            if end is None or call is None or call[0] not in self.functions:
                rest = body[at:].rstrip()
                self._space = space
                self._content(rest.removesuffix("]").rstrip(), out, before_call=False)
                break
            out += self._whole([call])
            following = _NEXT_OBJECT.match(body, end)
            at = following.end() if following else -1
        return out

    def parse(self, body: str) -> list[tuple[str, str]] | None:
        rest = body.removeprefix(self.start).strip()
        if rest.startswith("["):
            values = _loads(rest)
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


#: the characters of a Mistral call id
_ID_CHARACTERS = string.ascii_letters + string.digits

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
