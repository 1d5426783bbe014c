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
with special tokens kept, and the parser takes them out.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Collection

from aiocb.server.fragments import Content, Fragment, HiddenTexts, Reasoning, ToolCall, merged, partial_suffix

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


def is_harmony_template(chat_template: object) -> bool:
    """Whether a tokenizer's chat template (or any of its named ones) writes harmony."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return any(isinstance(t, str) and CHANNEL in t and MESSAGE in t for t in templates)


class HarmonyOutput:
    """One chat choice's harmony output, parsed as it streams (the interface of
    :class:`~aiocb.server.chat_output.ChoiceOutput`).

    ``functions`` are those the request offered (None: no tools: every message is content
    or reasoning); ``hidden`` the texts of special tokens the client asked to skip, left
    out of the text (the markers are always)."""

    def __init__(self, functions: Collection[str] | None, hidden: Collection[str] = ()) -> None:
        self._functions = None if functions is None else frozenset(functions)
        self._hidden = HiddenTexts([text for text in hidden if text not in MARKERS])
        self.calls = 0
        self._buffer = ""
        #: reading a header (the output begins in the first one)
        self._in_header = True
        #: the message being read: "reasoning", "content" or a function's name (a call)
        self._kind = "content"
        self._arguments: list[str] = []
        #: the kind of text ("reasoning" or "content") the last message with some gave
        self._last = ""
        #: what goes before the message's first text: a line break after a message of its kind
        self._opening = ""

    def feed(self, text: str) -> list[Fragment]:
        """The fragments ``text`` completes."""
        self._buffer += self._hidden.feed(text)
        out: list[Fragment] = []
        while self._buffer:
            if self._in_header:
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    if len(self._buffer) > _MOST_HEADER:  # (no harmony: the text is the answer)
                        self._in_header, self._kind = False, "content"
                        continue
                    break
                self._kind = self._header_kind(self._buffer[:at])
                self._opening = "\n" if self._kind == self._last else ""
                self._buffer = self._buffer[at + len(MESSAGE) :]
                self._in_header = False
                continue
            end, marker = min(((self._buffer.find(m), m) for m in _ENDS if m in self._buffer), default=(-1, ""))
            if end < 0:
                keep = max(partial_suffix(self._buffer, m) for m in _ENDS)
                self._body(self._buffer[: len(self._buffer) - keep], out)
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
        if self._in_header:
            # (a header never finished: a model that wrote no harmony; markers left out)
            rest = self._buffer
            for marker in MARKERS:
                rest = rest.replace(marker, "")
            if rest.strip():
                out.append(Content(rest))
        else:
            self._body(self._buffer, out)
            self._close(out, cut=cut)
        self._buffer = ""
        return merged(out)

    def _header_kind(self, header: str) -> str:
        """What a message of ``header`` is (see the module's docstring)."""
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            name = recipient.group(1)
            if name.startswith(_FUNCTIONS) and self._functions is not None:
                return name[len(_FUNCTIONS) :]  # (offered or not: see _close)
            if not name.startswith(_FUNCTIONS):
                return "reasoning"  # (a built-in tool's call: part of the chain of thought)
            return "content"
        channel = header.partition(CHANNEL)[2].split(maxsplit=1)
        return "reasoning" if channel and channel[0] == "analysis" else "content"

    def _body(self, text: str, out: list[Fragment]) -> None:
        if not text:
            return
        if self._kind not in ("reasoning", "content"):
            self._arguments.append(text)
            return
        text, self._opening, self._last = self._opening + text, "", self._kind
        out.append(Reasoning(text) if self._kind == "reasoning" else Content(text))

    def _close(self, out: list[Fragment], *, cut: bool) -> None:
        """The message read ends: a call's, its call (or, to a function not offered, its
        body as content; cut at its length limit before any argument, nothing)."""
        if self._kind in ("reasoning", "content"):
            return
        name, arguments = self._kind, "".join(self._arguments).strip()
        self._arguments = []
        self._kind = "content"
        assert self._functions is not None
        if name not in self._functions:
            if arguments:
                out.append(Content(arguments))
            return
        if cut and not arguments:
            return
        out.append(ToolCall(self.calls, f"call_{uuid.uuid4().hex[:24]}", name, arguments))
        self.calls += 1
