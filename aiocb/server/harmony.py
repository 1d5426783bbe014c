"""gpt-oss's harmony format: a chat output's messages as reasoning, content and tool calls.

A harmony output is a run of messages, each a header and a body between special tokens:
``<|channel|>analysis<|message|>...<|end|>`` (the prompt ends with the first message's
``<|start|>assistant``), then ``<|start|>assistant<|channel|>final<|message|>...<|return|>``,
or a call: ``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>{...}<|call|>`` (the recipient may come before the channel too). The
``analysis`` channel is the model's reasoning (``reasoning_content``), as is a message to a
built-in tool (``to=browser.search``, ``to=python``), which the server cannot run; ``final``
and ``commentary`` (a preamble to calls) are content; a message to ``functions.NAME`` is a
call of a function the request offered (else its body stays content, as other formats'
calls of unknown functions do). The markers never reach the client: the output is decoded
with special tokens kept, and the parser takes them out. Output constraints and enforced
tools hold for the final message and the calls alone (:func:`harmony_constraint`).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from aiocb.params import SamplingParams
from aiocb.server.fragments import (
    Content,
    Fragment,
    HiddenTexts,
    Reasoning,
    ToolArguments,
    ToolCall,
    call_id,
    merged,
    partial_suffix,
)
from aiocb.server.tools import ToolRequest, arguments_format
from aiocb.structured import answer_format

#: the name ``--reasoning-parser`` and ``--tool-call-parser`` take for it (vLLM's names)
REASONING_PARSER = "openai_gptoss"
TOOL_CALL_PARSER = "openai"

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
#: the markers that end a message's body (``<|start|>``: a model that left out its ``<|end|>``)
_ENDS = ("<|end|>", "<|return|>", "<|call|>", START)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *_ENDS[:3])
#: how many characters of a header are read before it is taken for content (a model that
#: wrote no harmony at all): real headers are a channel name and a recipient
_MOST_HEADER = 256
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_FUNCTIONS = "functions."


#: what goes between two messages of an output (the prompt ends with the first's)
_SEPARATOR = START + "assistant"
_CHANNEL, _MESSAGE = re.escape(CHANNEL), re.escape(MESSAGE)
#: a header's content type, where it has one (`` <|constrain|>json``, `` json``, `` code``;
#: bounded, as every part of a header is: a header of more than :data:`_MOST_HEADER`
#: characters is content to the parser)
_CONTENT_TYPE = f"(( ?{re.escape(CONSTRAIN)}| )[a-z]{{1,16}})?"
#: the built-in tools a header may name (gpt-oss's browser, python and container)
_BUILT_IN = r"(browser\.[a-z_]{1,32}|python|container\.[a-z_]{1,32})"
#: the texts that end a message's body for the parser (see :class:`HarmonyOutput`): a free
#: body holds none of them but the ``<|end|>`` that ends it (the output's last one, none)
_FREE_BODY_EXCLUDES = [START, "<|return|>", "<|call|>"]
_LAST_BODY_EXCLUDES = ["<|end|>", *_FREE_BODY_EXCLUDES]


def _recipient_header(recipient: str) -> str:
    """A regular expression of the headers of a message to ``recipient`` (a regular
    expression): in either channel, the recipient after the channel or in the role."""
    channel = f"{_CHANNEL}(commentary|analysis)"
    return f"({channel} to={recipient}| to={recipient}{channel}){_CONTENT_TYPE}{_MESSAGE}"


def harmony_constraint(answer: tuple[str, Any] | None, tools: ToolRequest | None, inside: str | None) -> dict[str, Any]:
    """The structural tag that holds a harmony output to its request's constraints: the
    final message's body to ``answer`` (a :class:`~aiocb.SamplingParams` field and its
    value: ``response_format``, structured outputs; None: any text) and the calls to what
    ``tools`` enforces (a strict function's arguments to its schema; ``required`` or a named
    function: a call and no final message), while the reasoning (``analysis`` messages),
    the preambles to calls and the calls of built-in tools (reasoning too) stay free, as
    vLLM's reasoning parser leaves them. Preambles and built-in tools' calls are left out
    where the answer is calls alone or ``answer`` holds the content (a built-in tool's call
    ends the output, which the server cannot go on with: an answer must come instead).

    ``inside`` is the kind of message the prompt ends inside (see :class:`HarmonyOutput`):
    a continued final message's body is the answer; a continued analysis goes on to its
    ``<|end|>`` first. The output's last message ends with the model's own end token
    (``<|return|>``, ``<|call|>``), which ends a complete grammar, so it is not in the
    format; a message before it ends with ``<|end|>``, which is text to the grammar, and
    holds no ``<|start|>`` (which would end it for the parser). InvalidRequestError naming
    what is wrong with ``answer``."""
    body: dict[str, Any] = {"type": "any_text", "excludes": _LAST_BODY_EXCLUDES}
    if answer is not None:
        structure = SamplingParams(**{answer[0]: answer[1]}).structure()
        assert structure is not None
        body = answer_format(structure)
    if inside == "content":  # (a final message goes on: no call can follow it)
        return {"type": "structural_tag", "format": body}
    calls_only = tools is not None and tools.calls_only
    last: list[dict[str, Any]] = []  # (the message that ends the output)
    free = {"type": "any_text", "excludes": _FREE_BODY_EXCLUDES}
    messages = [_tag(CHANNEL + "analysis" + MESSAGE, free, "<|end|>")]
    if not calls_only:
        last.append(_last(f"{_CHANNEL}final{_CONTENT_TYPE}{_MESSAGE}", body))
    if not calls_only and answer is None:
        last.append(_last(_recipient_header(_BUILT_IN), {"type": "any_text", "excludes": _LAST_BODY_EXCLUDES}))
        # (a preamble is content: calls alone leave it out, and an answer's constraint
        # holds for all the content)
        messages.append(_tag(CHANNEL + "commentary" + MESSAGE, free, "<|end|>"))
    if tools is not None:
        offered = [t["function"] for t in tools.tools]
        for function in offered if not tools.forced else [f for f in offered if f["name"] == tools.choice]:
            header = _recipient_header(re.escape("functions." + function["name"]))
            last.append(_last(header, arguments_format(tools, function)))
    ending: dict[str, Any] = {"type": "or", "elements": last}
    before = {"type": "tags_with_separator", "tags": messages, "separator": _SEPARATOR, "at_least_one": True}
    after_messages = {"type": "sequence", "elements": [before, {"type": "const_string", "value": _SEPARATOR}, ending]}
    output: dict[str, Any] = {"type": "or", "elements": [ending, after_messages]}
    if inside == "reasoning":
        continued = _tag("", free, "<|end|>")
        output = {"type": "sequence", "elements": [continued, {"type": "const_string", "value": _SEPARATOR}, output]}
    return {"type": "structural_tag", "format": output}


def _tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _last(header: str, body: dict[str, Any]) -> dict[str, Any]:
    """The output's last message, its header a regular expression: its end is the model's
    end token (a tag of no end could not take any text, which xgrammar refuses)."""
    return {"type": "sequence", "elements": [{"type": "regex", "pattern": header}, body]}


def is_harmony_template(chat_template: object) -> bool:
    """Whether a tokenizer's chat template (or any of its named ones) writes harmony."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return any(isinstance(t, str) and CHANNEL in t and MESSAGE in t for t in templates)


class HarmonyOutput:
    """One chat choice's harmony output, parsed as it streams (the interface of
    :class:`~aiocb.server.chat_output.ChoiceOutput`).

    ``functions`` are those the request offered (None: no tools: every message is content
    or reasoning); ``hidden`` the texts of special tokens the client asked to skip, left
    out of the text (the markers are always); ``inside`` the kind of message the prompt
    ends inside ("content" or "reasoning": a continued message's body; None: the output
    begins with a header). A header the output ends in (cut by its length limit or a
    stop string) is left out; text that is no harmony at all is content."""

    def __init__(
        self,
        functions: Collection[str] | None,
        hidden: Collection[str] = (),
        inside: str | None = None,
        json_kinds: Collection[str] = (),
        forced: str | None = None,
    ) -> None:
        self._functions = None if functions is None else frozenset(functions)
        #: the function ``tool_choice`` names, if it names one: an output cut at its length
        #: limit before its call's arguments is that call, with none written (as OpenAI's)
        self._forced = forced
        #: the kinds of message ("call", "content") whose bodies a grammar holds to JSON: a
        #: marker's text inside one of its strings is the string's, not the body's end
        self._json_kinds = frozenset(json_kinds)
        #: reading such a body (set below and by :meth:`_begin`): how much of the buffer its
        #: JSON state has taken in, and whether that ends inside a string (after a backslash)
        self._scanned = 0
        self._in_string = self._escaped = False
        self._hidden = HiddenTexts([text for text in hidden if text not in MARKERS])
        self.calls = 0
        self._buffer = ""
        #: reading a header (the output begins in one, unless it continues a message)
        self._in_header = inside is None
        #: whether a message began (the output is harmony)
        self._started = inside is not None
        #: the message being read: "reasoning", "content" or "call" ...
        self._kind = inside or "content"
        #: ... of this function, with these arguments so far
        self._function = ""
        self._arguments: list[str] = []
        #: a call to a function offered: its index once its first argument's text came (its
        #: arguments stream from there), and whitespace at their end, held until more follows
        self._call: int | None = None
        self._held_space = ""
        #: the kinds of text ("reasoning", "content") messages gave so far
        self._wrote: set[str] = set()
        #: what goes before the message's first text: a line break after a message of its kind
        self._opening = ""
        self._json: bool = inside is not None and inside in self._json_kinds

    def feed(self, text: str) -> list[Fragment]:
        """The fragments ``text`` completes."""
        self._buffer += self._hidden.feed(text)
        out: list[Fragment] = []
        while self._buffer:
            if self._in_header:
                at = self._buffer.find(MESSAGE)
                if at < 0 and len(self._buffer) < _MOST_HEADER + len(MESSAGE):  # (a marker may be coming)
                    break
                if at < 0 or at > _MOST_HEADER:  # (no header: the text is content, whatever its split)
                    self._begin("content")
                    if self._buffer.startswith(START):  # (its own start would end it again at once)
                        self._buffer = self._buffer[len(START) :]
                    continue
                self._begin(*self._header_kind(self._lead(self._buffer[:at], out)))
                self._buffer = self._buffer[at + len(MESSAGE) :]
                continue
            if self._json:
                end, marker = self._end_outside_strings()
            else:
                end, marker = min(((self._buffer.find(m), m) for m in _ENDS if m in self._buffer), default=(-1, ""))
            if end < 0:
                keep = max(partial_suffix(self._buffer, m) for m in MARKERS)
                self._body(self._buffer[: len(self._buffer) - keep], out)
                self._scanned -= len(self._buffer) - keep
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            self._body(self._buffer[:end], out)
            self._close(out, cut=False)
            # (after a message's end the next header follows: <|start|>assistant...)
            self._buffer = self._buffer[end + (0 if marker == START else len(marker)) :]
            self._in_header = True
        return merged(out)

    def finish(self, *, cut: bool = False) -> list[Fragment]:
        """What is left at the end of the output (``cut``: it ended at its length limit)."""
        self._buffer += self._hidden.finish()
        out: list[Fragment] = []
        if not self._in_header:
            self._body(self._buffer, out)
            self._close(out, cut=cut)
        elif not self._started and not _opens_header(self._buffer):  # (no harmony at all)
            self._begin("content")
            self._body(self._buffer, out)
        self._buffer = ""
        if cut and self._forced is not None and not self.calls:
            out.append(ToolCall(self.calls, call_id(), self._forced, ""))
            self.calls += 1
        return merged(out)

    def _begin(self, kind: str, function: str = "") -> None:
        """A message's body begins (a call's: of ``function``)."""
        self._in_header, self._started, self._kind, self._function = False, True, kind, function
        self._opening = "\n" if kind in self._wrote else ""
        self._json = kind in self._json_kinds
        self._scanned, self._in_string, self._escaped = 0, False, False

    def _end_outside_strings(self) -> tuple[int, str]:
        """Where the JSON body in the buffer ends: the first end marker outside its strings
        (-1 if none yet; the buffer's JSON state is kept up to where it was read)."""
        buffer, i = self._buffer, self._scanned
        while i < len(buffer):
            char = buffer[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char == "<":
                for marker in _ENDS:
                    if buffer.startswith(marker, i):
                        self._scanned = i
                        return i, marker
                if any(marker.startswith(buffer[i:]) for marker in _ENDS):
                    break  # (a marker's start: read on once more has come)
            i += 1
        self._scanned = i
        return -1, ""

    def _lead(self, header: str, out: list[Fragment]) -> str:
        """``header`` less text before the output's first header that is no part of one
        (neither a role nor a recipient): that is content."""
        if self._started:
            return header
        first = min((at for at in (header.find(START), header.find(CHANNEL)) if at >= 0), default=len(header))
        lead = header[:first]
        if "to=" in lead or lead.strip() in ("", "assistant"):
            return header
        self._begin("content")
        self._body(lead, out)
        return header[first:]

    def _header_kind(self, header: str) -> tuple[str, str]:
        """What a message of ``header`` is, and the function it calls (see the module's docstring)."""
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            name = recipient.group(1)
            if name.startswith(_FUNCTIONS) and self._functions is not None:
                return "call", name[len(_FUNCTIONS) :]  # (offered or not: see _close)
            if not name.startswith(_FUNCTIONS):
                return "reasoning", ""  # (a built-in tool's call: part of the chain of thought)
            return "content", ""
        channel = header.partition(CHANNEL)[2].split(maxsplit=1)
        return ("reasoning" if channel and channel[0] == "analysis" else "content"), ""

    def _body(self, text: str, out: list[Fragment]) -> None:
        if not self._json:  # (text that is no harmony, or a stray marker in a body; not a JSON string's)
            for marker in MARKERS:
                text = text.replace(marker, "")
        if not text:
            return
        if self._kind == "call":
            self._call_text(text, out)
            return
        text, self._opening = self._opening + text, ""
        self._wrote.add(self._kind)
        out.append(Reasoning(text) if self._kind == "reasoning" else Content(text))

    def _call_text(self, text: str, out: list[Fragment]) -> None:
        """More of a call's body: to a function offered, its arguments, streamed from their
        first text that is not whitespace (the call begins there; whitespace around them is
        left out); to another, gathered for :meth:`_close`."""
        assert self._functions is not None
        if self._function not in self._functions:
            self._arguments.append(text)
            return
        text = self._held_space + text
        arguments = text.rstrip()
        self._held_space = text[len(arguments) :]
        if self._call is not None:
            if arguments:
                out.append(ToolArguments(self._call, arguments))
            return
        arguments = arguments.lstrip()
        if not arguments:
            self._held_space = ""
            return
        self._call = self.calls
        out.append(ToolCall(self.calls, call_id(), self._function, arguments))
        self.calls += 1

    def _close(self, out: list[Fragment], *, cut: bool) -> None:
        """The message read ends: a call's (its arguments streamed as they came), or one to
        a function not offered, whose body is content; one with no arguments is a call of
        none, or nothing when it was cut at its length limit."""
        if self._kind != "call":
            return
        name, arguments = self._function, "".join(self._arguments).strip()
        began, self._call, self._held_space, self._arguments = self._call is not None, None, "", []
        self._kind, self._function = "content", ""
        assert self._functions is not None
        if name not in self._functions:
            if arguments:
                out.append(Content(arguments))
            return
        if began or cut:
            return
        out.append(ToolCall(self.calls, call_id(), name, ""))
        self.calls += 1


def _opens_header(text: str) -> bool:
    """Whether ``text`` (an output's unfinished start) begins a header, or may."""
    stripped = text.lstrip()
    return stripped.startswith(("to=", START, CHANNEL)) or START.startswith(stripped) or CHANNEL.startswith(stripped)
