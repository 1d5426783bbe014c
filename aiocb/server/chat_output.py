"""A chat choice's text as an assistant message: reasoning, content and tool calls.

:class:`ChoiceOutput` runs one choice's text through the reasoning splitter (when the
server has one) and then the tool-call parser (when the request offers tools), as it
streams. The same fragments become a stream's deltas (:func:`delta`) and, gathered by
:class:`MessageBuilder`, the whole message of a response that is not streamed, so the
two always agree.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from aiocb.server.fragments import Content, Fragment, HiddenTexts, Reasoning, ToolArguments, ToolCall, merged
from aiocb.server.reasoning import ReasoningSplitter
from aiocb.server.tool_parsers import ToolCallParser


class ChoiceOutput:
    """One choice's text, parsed as it comes.

    ``hidden`` are the texts of special tokens kept for the tool-call parser that the client
    asked to skip: the parser leaves them out of the content, and they are left out of the
    reasoning here (a tool call's marker too: there it marks no call)."""

    def __init__(
        self, reasoning: ReasoningSplitter | None, tools: ToolCallParser | None, hidden: Collection[str] = ()
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._hidden = HiddenTexts(hidden) if reasoning is not None and hidden else None

    @property
    def calls(self) -> int:
        """Tool calls found so far."""
        return 0 if self._tools is None else self._tools.calls

    def feed(self, text: str) -> list[Fragment]:
        """The fragments ``text`` completes (merged where they are of one kind)."""
        if not text:
            return []
        split: list[Fragment] = self._reasoning.feed(text) if self._reasoning is not None else [Content(text)]
        return merged(self._parse_tools(self._hide(split, finish=False), finish=False))

    def finish(self, *, cut: bool = False) -> list[Fragment]:
        """What is left at the end of the output (``cut``: it ended at its length limit)."""
        split = self._reasoning.finish() if self._reasoning is not None else []
        return merged(self._parse_tools(self._hide(split, finish=True), finish=True, cut=cut))

    def _hide(self, fragments: list[Fragment], *, finish: bool) -> list[Fragment]:
        """The reasoning without hidden texts (what was held of it released where it ends)."""
        hidden = self._hidden
        if hidden is None:
            return fragments
        out: list[Fragment] = []
        for fragment in fragments:
            text = hidden.feed(fragment.text) if isinstance(fragment, Reasoning) else hidden.finish()
            if text:
                out.append(Reasoning(text))
            if not isinstance(fragment, Reasoning):
                out.append(fragment)
        if finish and (rest := hidden.finish()):
            out.append(Reasoning(rest))
        return out

    def _parse_tools(self, fragments: list[Fragment], *, finish: bool, cut: bool = False) -> list[Fragment]:
        if self._tools is None:
            return fragments
        out: list[Fragment] = []
        for fragment in fragments:
            out += self._tools.feed(fragment.text) if isinstance(fragment, Content) else [fragment]
        if finish:
            out += self._tools.finish(cut=cut)
        return out


def delta(fragment: Fragment) -> dict[str, Any]:
    """A stream chunk's ``delta`` for one fragment, in OpenAI's shape: a call's first delta
    has its id and name, the next ones more of its arguments (by the call's index)."""
    if isinstance(fragment, Content):
        return {"content": fragment.text}
    if isinstance(fragment, Reasoning):
        return {"reasoning_content": fragment.text}
    if isinstance(fragment, ToolArguments):
        return {"tool_calls": [{"index": fragment.index, "function": {"arguments": fragment.text}}]}
    return {"tool_calls": [{"index": fragment.index} | _call(fragment.id, fragment.name, fragment.arguments)]}


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class MessageBuilder:
    """A choice's fragments gathered into the response's ``message``."""

    def __init__(self, *, reasoning: bool, calls_only: bool = False) -> None:
        self._reasoning = reasoning
        #: whether the answer is tool calls alone: no content, even without a call
        self._calls_only = calls_only
        self._content: list[str] = []
        self._thoughts: list[str] = []
        #: each call's id, name and arguments' pieces, by index
        self._calls: dict[int, tuple[str, str, list[str]]] = {}

    def add(self, fragments: list[Fragment]) -> None:
        """Take more of the choice's fragments."""
        for fragment in fragments:
            if isinstance(fragment, Content):
                self._content.append(fragment.text)
            elif isinstance(fragment, Reasoning):
                self._thoughts.append(fragment.text)
            elif isinstance(fragment, ToolCall):
                self._calls[fragment.index] = (fragment.id, fragment.name, [fragment.arguments])
            else:
                self._calls[fragment.index][2].append(fragment.text)

    def message(self) -> dict[str, Any]:
        """The assistant message: ``content`` is null when the answer is tool calls only, or
        reasoning only (as vLLM's: a text that never left the thinking)."""
        content = "".join(self._content)
        no_content = self._calls_only or bool(self._calls) or (self._reasoning and bool(self._thoughts))
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not no_content else None}
        if self._reasoning:
            message["reasoning_content"] = "".join(self._thoughts) if self._thoughts else None
        if self._calls:
            message["tool_calls"] = [_call(i, name, "".join(pieces)) for i, name, pieces in self._calls.values()]
        return message
