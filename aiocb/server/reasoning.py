"""``<think>…</think>``: a reasoning model's thoughts, split from its answer as it streams.

The text inside the block becomes the message's ``reasoning_content``, the text after it
``content``. Three shapes occur: the output opens the block itself (``<think>`` first);
the chat template opened it in the prompt, so the output starts inside it (DeepSeek-R1,
Qwen3 with thinking on); or there is no block at all (thinking off), when everything is
content. A block never closed (the output was cut short) is all reasoning.
"""

from __future__ import annotations

from typing import Any, ClassVar

from aiocb.params import SamplingParams
from aiocb.server.fragments import Content, Fragment, Reasoning, partial_suffix
from aiocb.structured import answer_format

OPEN = "<think>"
CLOSE = "</think>"
#: the message fields a template renders as a ``<think>`` block (transformers' names)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def prompt_opens_thinking(prompt: str, continued: str | None = None) -> bool:
    """Whether the rendered prompt ends inside a ``<think>`` block: the template opened it
    (the prompt ends with it), or ``continued``, the assistant message's content the prompt
    ends with (``continue_final_message``), did. A ``<think>`` anywhere else, in a user's message
    say, opens nothing."""
    if prompt.rstrip().endswith(OPEN):
        return True
    return continued is not None and continued.rfind(OPEN) > continued.rfind(CLOSE)


def after_thinking(field: str, value: Any, *, opened: bool) -> dict[str, Any]:
    """A structural tag that leaves a reasoning model's ``<think>`` block free and applies
    the output constraint ``field=value`` (a :class:`~aiocb.SamplingParams` field) to the
    answer after it, as vLLM does with a reasoning parser: the block is the one the prompt
    ``opened``, else one the output may open first. Up to two newlines may come between
    the block and the answer (``</think>\n\n``, as these models write it)."""
    structure = SamplingParams(**{field: value}).structure()
    assert structure is not None
    return {"type": "structural_tag", "format": thinking_first(answer_format(structure), opened=opened)}


def thinking_first(answer: dict[str, Any], *, opened: bool) -> dict[str, Any]:
    """A structural tag's format: a free ``<think>`` block (the one the prompt ``opened``,
    else one the output may open) and up to two newlines after it, then ``answer``
    (without a block, the answer comes first: the newlines are the block's)."""
    thinking = {"type": "tag", "begin": "" if opened else OPEN, "content": {"type": "any_text"}, "end": CLOSE}
    block: dict[str, Any] = {"type": "sequence", "elements": [thinking, {"type": "regex", "pattern": "\\n{0,2}"}]}
    if not opened:
        block = {"type": "optional", "content": block}
    return {"type": "sequence", "elements": [block, answer]}


class ReasoningSplitter:
    """Splits one choice's text into reasoning and content fragments."""

    #: the names ``--reasoning-parser`` takes (vLLM's names for this format)
    names: ClassVar[tuple[str, ...]] = ("qwen3", "deepseek_r1")

    def __init__(self, *, starts_inside: bool) -> None:
        self._state = "reasoning" if starts_inside else "start"
        self._buffer = ""

    def feed(self, text: str) -> list[Fragment]:
        """The fragments ``text`` completes."""
        self._buffer += text
        out: list[Fragment] = []
        while self._buffer:
            if self._state == "start":
                head = self._buffer.lstrip()
                if head.startswith(OPEN):
                    self._buffer, self._state = head[len(OPEN) :], "reasoning"
                elif not head or OPEN.startswith(head):
                    break  # (not decided yet)
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                at = self._buffer.find(CLOSE)
                if at >= 0:
                    self._emit(Reasoning(self._buffer[:at]), out)
                    self._buffer, self._state = self._buffer[at + len(CLOSE) :], "after"
                    continue
                keep = partial_suffix(self._buffer, CLOSE)
                self._emit(Reasoning(self._buffer[: len(self._buffer) - keep]), out)
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            elif self._state == "after":
                # The newlines templates put between the block and the answer are neither.
                self._buffer = self._buffer.lstrip("\n")
                if self._buffer:
                    self._state = "content"
            else:
                self._emit(Content(self._buffer), out)
                self._buffer = ""
        return out

    def finish(self) -> list[Fragment]:
        """What is left at the end of the output."""
        out: list[Fragment] = []
        if self._state == "reasoning":
            self._emit(Reasoning(self._buffer), out)
        elif self._state != "after":
            self._emit(Content(self._buffer), out)
        self._buffer = ""
        return out

    @staticmethod
    def _emit(fragment: Content | Reasoning, out: list[Fragment]) -> None:
        if fragment.text:
            out.append(fragment)
