"""OpenAI's ``tools`` and ``tool_choice``: checked, handed to the chat template, enforced.

A chat request's tools are rendered by the model's chat template (``tools=``). What the
model may do with them is ``tool_choice``:

- ``none``: no calls; the template still shows the tools (as vLLM's default), and the
  output is plain text (one that reads like a call is content).
- ``auto`` (the default with tools): the model may call them; the server's tool-call
  parser finds the calls in its output. Tools marked ``strict`` are enforced: the output
  follows a structural tag (xgrammar) in the parser's format, so a call's arguments
  always validate; without ``strict`` the output is free (while some tool is strict, the
  other tools' calls take any JSON object as arguments).
- ``required`` and a named function: enforced the same way, with at least one call (or
  exactly the named one), and nothing but calls: no text before, between or after them.

A function without ``parameters`` takes none (OpenAI's empty parameter list): where it
is enforced, its arguments are ``{}``.

Assistant messages' ``tool_calls`` arrive with ``arguments`` as JSON text; templates
expect objects, so they are parsed before rendering.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiocb.server.protocol import bad_request, refuse_unknown_keys, without_unset
from aiocb.server.reasoning import CLOSE, thinking_first

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
#: Tool-call JSON may hold at most this many whitespace characters in a row: a weak model
#: could otherwise pad its arguments without end.
_MAX_WHITESPACE = 1
#: The arguments of a function without ``parameters``, enforced: none.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
#: The arguments of a call that is not enforced: any object (a call's arguments always are).
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat request's tools and what it lets the model do with them."""

    #: the tools as sent (``{"type": "function", "function": {...}}``), for the template
    tools: tuple[dict[str, Any], ...]
    #: ``"none"``, ``"auto"``, ``"required"``, or the name of the one function to call
    choice: str
    #: whether the function named by :attr:`choice` is forced (a name, not a mode)
    forced: bool
    #: whether the model may call several tools in one answer
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        """The functions' names."""
        return frozenset(tool["function"]["name"] for tool in self.tools)

    @property
    def enforced(self) -> bool:
        """Whether the output is constrained to the parser's tool-call format."""
        if self.choice == "none":
            return False
        return self.calls_only or any(_strict(tool) for tool in self.tools)

    @property
    def calls_only(self) -> bool:
        """Whether the output is tool calls and nothing else (``required``, a named function)."""
        return self.forced or self.choice == "required"

    def xgrammar_tool_choice(self) -> str | dict[str, Any]:
        """``tool_choice`` as xgrammar's builders take it."""
        if self.forced:
            return {"type": "function", "function": {"name": self.choice}}
        return self.choice


def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """The tools of a chat body, checked; None when it has none (and no ``tool_choice``)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(f"'parallel_tool_calls' must be true or false, got {parallel!r}", "parallel_tool_calls")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tools", "tools")
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    checked = tuple(_tool(tool, i) for i, tool in enumerate(tools))
    names = [tool["function"]["name"] for tool in checked]
    seen: set[str] = set()  # (a set: 50,000 tools checked against a list took 90 s)
    for j, name in enumerate(names):
        if name in seen:
            where = f"tools[{j}].function.name"
            raise bad_request(f"'{where}' is {name!r}, which an earlier tool is named too", where)
        seen.add(name)
    forced = False
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        choice, forced = _named_choice(choice, names), True
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"'tool_choice' must be none, auto, required or a function, got {choice!r}", "tool_choice")
    return ToolRequest(tools=checked, choice=choice, forced=forced, parallel=True if parallel is None else parallel)


def _named_choice(choice: dict[str, Any], names: list[str]) -> str:
    """The function a ``tool_choice`` object names, checked."""
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(
            '\'tool_choice\' must be none, auto, required or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    refuse_unknown_keys(choice, ("type", "function"), "tool_choice")
    refuse_unknown_keys(function, ("name",), "tool_choice.function")
    name: str = function["name"]
    if name not in names:
        where = "tool_choice.function.name"
        raise bad_request(f"'{where}' is {name!r}, which is not one of the tools", where)
    return name


def _tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    if tool.get("type") != "function":
        raise bad_request(f"{where}.type must be 'function', got {tool.get('type')!r}", f"{where}.type")
    if not isinstance(tool.get("function"), dict):
        raise bad_request(f"{where}.function must be an object", f"{where}.function")
    refuse_unknown_keys(tool, ("type", "function"), where)
    where += ".function"
    function = dict(tool["function"])
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"{where}.name must be 1 to 64 letters, digits, '_', '.' or '-'", f"{where}.name")
    known = ("name", "description", "parameters", "strict")
    refuse_unknown_keys(function, known, where)
    function = without_unset(function, known)  # (a null key is none given: not the template's either)
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise bad_request(f"{where}.description must be a string", f"{where}.description")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.parameters must be a JSON schema object", f"{where}.parameters")
    if parameters is not None and parameters.get("type", "object") != "object":
        # (arguments are an object: OpenAI refuses another root type too)
        raise bad_request(
            f'{where}.parameters must be a JSON schema of "type": "object", got "type": {parameters["type"]!r}',
            f"{where}.parameters",
        )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict must be true or false", f"{where}.strict")
    return {"type": "function", "function": function}


def _strict(tool: Mapping[str, Any]) -> bool:
    return bool(tool["function"].get("strict"))


def template_messages(
    messages: list[dict[str, Any]], template_id: Callable[[str], str] | None = None
) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: a tool call's ``arguments`` as an object, and
    call ids (a call's, a tool result's) as ``template_id`` makes them, where given (the tool
    parser's :meth:`~aiocb.server.tool_parsers.ToolCallParser.template_id`)."""
    rendered = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if template_id is not None and isinstance(message.get("tool_call_id"), str):
            message = {**message, "tool_call_id": template_id(message["tool_call_id"])}
        if calls is None:
            rendered.append(message)
            continue
        if not isinstance(calls, list):
            raise bad_request(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
        calls = [_template_call(call, i, j) for j, call in enumerate(calls)]
        if template_id is not None:
            calls = [
                {**call, "id": template_id(call["id"])} if isinstance(call.get("id"), str) else call for call in calls
            ]
        rendered.append({**message, "tool_calls": calls})
    return rendered


#: A call of an assistant message: OpenAI's fields, and ``index``, a streamed call's position,
#: which a client that rebuilt the message from its deltas sends back (the list's order says
#: the same). Its function's ``parsed_arguments`` is the openai client's parse of
#: ``arguments``, which a parsed message sent back holds: a copy that says nothing new.
_CALL_FIELDS = ("id", "type", "function", "index")
_CALL_FUNCTION_FIELDS = ("name", "arguments", "parsed_arguments")


def _template_call(call: Any, i: int, j: int) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{where} must be a function call with a 'name' and 'arguments'", where)
    refuse_unknown_keys(call, _CALL_FIELDS, where, "a tool call")
    if call.get("type") not in (None, "function"):
        raise bad_request(f"{where}.type must be 'function', got {call['type']!r}", f"{where}.type")
    refuse_unknown_keys(function, _CALL_FUNCTION_FIELDS, f"{where}.function")
    call, function = without_unset(call, _CALL_FIELDS), without_unset(function, _CALL_FUNCTION_FIELDS)
    where += ".function.arguments"
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise bad_request(f"{where} is not valid JSON: {exc}", where) from None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where} must be a JSON object (or its text), got {type(arguments).__name__}", where)
    # Templates read the call either at the top level (Llama 3) or under "function" (Qwen).
    function = {**function, "arguments": arguments}
    return {**call, "function": function, "name": function["name"], "arguments": arguments}


def structural_tag(
    request: ToolRequest, model_format: str | dict[str, str], reasoning: str, separator: str
) -> dict[str, Any]:
    """The structural tag that enforces ``request`` in a tool-call format.

    ``model_format`` is an xgrammar builtin format name (``"qwen_3"``, ``"llama"``) or a
    single-call format ``{"begin": ..., "name_end": ..., "end": ..., "trigger": ...}`` for
    one xgrammar does not build; ``reasoning`` is xgrammar's mode for a leading
    ``<think>`` block (``"disabled"``, ``"enabled"``: the prompt opened it, ``"auto"``);
    ``separator`` goes between two calls where nothing else may (``required``, a named
    function).
    """
    try:
        import xgrammar
    except ImportError:
        raise bad_request("enforcing tool calls needs xgrammar: pip install 'aiocb[structured]'", "tools") from None
    if isinstance(model_format, dict):
        tag = _single_call_tag(request, model_format)
    else:
        # Each function with the schema its arguments follow, and no "strict": xgrammar reads
        # a missing schema, or "strict": false, as any JSON value (a call the parser drops).
        tools = [
            {
                "type": "function",
                "function": {"name": function["name"], "parameters": _arguments_schema(request, function)},
            }
            for function in (tool["function"] for tool in request.tools)
        ]
        try:
            built = xgrammar.get_model_structural_tag(
                model_format,
                tools=tools,
                tool_choice=request.xgrammar_tool_choice(),
                reasoning=reasoning,
                max_whitespace_cnt=_MAX_WHITESPACE,
                parallel_tool_calls=request.parallel,
            )
        except ValueError as exc:
            raise bad_request(f"the tools cannot be enforced: {exc}", "tools") from None
        tag = built.model_dump(mode="json")
    return _thinking_first(_calls_only(tag, separator) if request.calls_only else tag, reasoning)


def _thinking_first(tag: dict[str, Any], reasoning: str) -> dict[str, Any]:
    """``tag`` after a free ``<think>`` block where the reasoning mode asks for one and the
    format has none of its own (xgrammar's ``qwen_3`` has; its ``llama`` and the single-call
    formats have not: a call forced at once could never follow the thinking)."""
    if reasoning == "disabled" or _ends_thinking(tag["format"]):
        return tag
    return {**tag, "format": thinking_first(tag["format"], opened=reasoning == "enabled")}


def _ends_thinking(node: Any) -> bool:
    """Whether a structural tag's format has a tag that closes a ``<think>`` block."""
    if isinstance(node, list):
        return any(_ends_thinking(item) for item in node)
    if not isinstance(node, dict):
        return False
    return node.get("end") == CLOSE or any(_ends_thinking(value) for value in node.values())


def _calls_only(node: Any, separator: str) -> Any:
    """``node`` (a structural tag, or a part of one) with each triggered-tags format that
    must match a call (xgrammar's form for ``required``: free text allowed around the
    calls) made a tags-with-separator one: the calls, ``separator`` between two, and no
    other text."""
    if isinstance(node, list):
        return [_calls_only(item, separator) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "triggered_tags" and node.get("at_least_one"):
        return {
            "type": "tags_with_separator",
            "tags": node["tags"],
            "separator": separator,
            "at_least_one": True,
            "stop_after_first": node["stop_after_first"],
        }
    return {key: _calls_only(value, separator) for key, value in node.items()}


def _arguments_schema(request: ToolRequest, function: Mapping[str, Any]) -> dict[str, Any]:
    """The schema a call of ``function`` has its arguments follow: its parameters where
    they are enforced (``required``, a named function, a strict tool), else any object."""
    if request.choice == "auto" and not function.get("strict"):
        return _ANY_OBJECT
    parameters: dict[str, Any] | None = function.get("parameters")
    if parameters is None:
        return _NO_PARAMETERS
    # (a schema that says no type, as ``{}``, is of an object's arguments all the same)
    return parameters if "type" in parameters else {**parameters, "type": "object"}


def arguments_format(request: ToolRequest, function: Mapping[str, Any]) -> dict[str, Any]:
    """A structural tag's format for the arguments of a call of ``function`` (its
    ``function`` object): JSON under the schema they follow (see :class:`ToolRequest`)."""
    schema = _arguments_schema(request, function)
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": _MAX_WHITESPACE}


def _single_call_tag(request: ToolRequest, fmt: dict[str, str]) -> dict[str, Any]:
    """A triggered-tags structural tag with one tag per function: ``begin + name + name_end``,
    the arguments under the function's schema (any JSON object unless strict or enforced),
    then ``end``."""
    tools = [t for t in request.tools if not request.forced or t["function"]["name"] == request.choice]
    tags = []
    for tool in tools:
        function = tool["function"]
        tags.append(
            {
                "type": "tag",
                "begin": fmt["begin"] + function["name"] + fmt["name_end"],
                "content": arguments_format(request, function),
                "end": fmt["end"],
            }
        )
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [fmt["trigger"]],
            "tags": tags,
            "at_least_one": request.choice != "auto",
            "stop_after_first": request.forced or not request.parallel,  # (a named function: one call)
        },
    }
