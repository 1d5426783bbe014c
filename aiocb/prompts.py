"""Prompts given as text or chat messages, turned into token ids with the manager's tokenizer."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from aiocb.errors import InvalidRequestError
from aiocb.tokenizer_process import TokenizerProcessHolder, encode_kept

#: A prompt: token ids, a text, or chat messages (``[{"role": ..., "content": ...}, ...]``).
Prompt = Sequence[int] | str | Sequence[Mapping[str, Any]]

#: Text longer than this (characters) is tokenized on a worker thread by the async
#: methods: a fast tokenizer takes about a millisecond for 4,000 characters of prose.
LARGE_PROMPT_CHARS = 4000


def is_chat(prompt: Any) -> bool:
    """Whether ``prompt`` is a list of chat messages."""
    if isinstance(prompt, str) or not isinstance(prompt, Sequence) or not prompt:
        return False
    return isinstance(prompt[0], Mapping)


def check_prompt_list(inputs: Any) -> None:
    """InvalidRequestError unless ``inputs`` holds prompts, not one prompt (a text, a chat,
    token ids: taken for a list of prompts, a text would be one request per character)."""
    one = "one prompt: pass a list of prompts ([prompt])"
    if inputs is None:
        raise InvalidRequestError("inputs is None: pass a list of prompts", param="inputs")
    if isinstance(inputs, (str, bytes)):
        raise InvalidRequestError(f"inputs is a text, {one}", param="inputs")
    if isinstance(inputs, Mapping) or is_chat(inputs):
        raise InvalidRequestError(f"inputs is a chat conversation, {one}", param="inputs")
    ndim = getattr(inputs, "ndim", None)  # (a tensor or an array: its rows are the prompts)
    if (isinstance(ndim, int) and ndim < 2) or (isinstance(inputs, Sequence) and inputs and isinstance(inputs[0], int)):
        raise InvalidRequestError(f"inputs are token ids, {one}", param="inputs")
    if not isinstance(inputs, Sequence) and not isinstance(ndim, int):
        raise InvalidRequestError(f"inputs must be a list of prompts, got {type(inputs).__name__}", param="inputs")


def is_large(prompt: Any) -> bool:
    """Whether tokenizing ``prompt`` may hold the event loop for more than about a millisecond."""
    if isinstance(prompt, str):
        return len(prompt) > LARGE_PROMPT_CHARS
    if is_chat(prompt):
        return _chat_chars(prompt, LARGE_PROMPT_CHARS) > LARGE_PROMPT_CHARS
    return False


def _chat_chars(messages: Sequence[Any], limit: int) -> int:
    """The characters of the strings in chat messages (their keys too: each message costs
    the template a turn), counted until past ``limit``: the tool calls' arguments and the
    turns count as much as the contents."""
    count = 0
    stack: list[Iterator[Any]] = [iter(messages)]
    while stack and count <= limit:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, str):
            count += len(item)
        elif isinstance(item, Mapping):
            count += sum(len(key) if isinstance(key, str) else 1 for key in item)
            stack.append(iter(item.values()))
        elif isinstance(item, Sequence):
            stack.append(iter(item))
        else:
            count += 1
    return count


_END = object()


def encode_prompt(
    prompt: Any,
    tokenizer: Any,
    processes: TokenizerProcessHolder | None = None,
    *,
    keep: int | None = None,
    limit: int | None = None,
) -> Any:
    """Token ids of a text or chat prompt (the chat template rendered with a generation
    prompt); anything else is returned as it is, to be checked as token ids.

    ``keep`` (``truncate_prompt_tokens``, resolved) and ``limit`` (the model's context) let
    a long text go to the tokenizer process (``processes``), which sends back only the
    last ``keep`` tokens, or none of a text with more than ``limit``: refused here, by its
    count.
    """
    text = prompt_text(prompt, tokenizer)
    if text is None:
        return prompt
    # (a chat template writes the special tokens, BOS and the like, itself)
    special = isinstance(prompt, str)
    try:
        tokenized = encode_kept(text, tokenizer, processes, add_special_tokens=special, keep=keep, limit=limit)
    except (TypeError, ValueError) as exc:  # (UnicodeError is a ValueError)
        raise InvalidRequestError(
            f"the prompt cannot be tokenized (is it valid Unicode text?): {exc}", param="input_ids"
        ) from None
    if keep is None and limit is not None and tokenized.total > limit:
        raise InvalidRequestError(
            f"the prompt has {tokenized.total} tokens, more than the model's context length of {limit}",
            param="input_ids",
        )
    return tokenized.ids


def prompt_text(prompt: Any, tokenizer: Any) -> str | None:
    """The text to tokenize for a text or chat prompt (the chat template rendered with a
    generation prompt); None for anything else."""
    if not isinstance(prompt, str) and not is_chat(prompt):
        return None
    if tokenizer is None:
        kind = "a text" if isinstance(prompt, str) else "chat messages"
        raise InvalidRequestError(
            f"the prompt is {kind}, which needs a tokenizer: pass tokenizer=... (to aiocb.Manager or "
            "aiocb.generate_batch), or pass token ids",
            param="input_ids",
        )
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "the tokenizer has no chat template, so chat messages cannot be rendered", param="input_ids"
        )
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be a mapping with a string 'role'", param="input_ids")
    try:
        text: str = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja2 errors, raise_exception() in templates
        raise InvalidRequestError(f"the chat template failed on these messages: {exc}", param="input_ids") from exc
    return text


def bad_words_ids(words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """vLLM's token sequences for ``bad_words``: each word (leading spaces dropped) as the
    tokenizer writes it alone, and after a space when that makes another first token in as
    many tokens (a word that begins the text and one inside it)."""
    sequences: list[list[int]] = []
    for word in words:
        alone: list[int] = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced: list[int] = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not alone:
            raise InvalidRequestError(f"bad_words: the tokenizer writes {word!r} as no token", param="bad_words")
        sequences.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return sequences
