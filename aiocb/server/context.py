"""What the request handlers share: the manager, the tokenizer, the metrics, and token texts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from aiocb.collector import full_collections_deferred
from aiocb.errors import InvalidRequestError
from aiocb.gil import pausing_call, switching_often
from aiocb.prompts import bad_words_ids
from aiocb.runner.model_spec import served_context
from aiocb.sampling import config_min_tokens, eos_ids
from aiocb.server.fragments import HiddenTexts
from aiocb.server.harmony import MARKERS as HARMONY_MARKERS
from aiocb.server.limits import ServerLimits
from aiocb.server.metrics import ServerMetrics
from aiocb.server.protocol import APIError, SamplingRequest, ServedDefaults, bad_request
from aiocb.server.remote import ServedEngine
from aiocb.server.tool_parsers import ToolCallParser
from aiocb.tokenizer_process import Tokenized, TokenizerProcessHolder, encode_kept

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Bodies up to this size are parsed and tokenized on the event loop (well under a
#: millisecond); larger ones in a tokenizer thread, so that a big prompt never holds
#: the loop (the tokenizers library releases the GIL while it encodes).
INLINE_BODY_BYTES = 2048
#: Bodies larger than this are worked on in a tokenizer thread of their own, one at a
#: time: a few of the largest (8 MiB of messages or tools take seconds to render) then
#: never hold up the ordinary ones queued behind them.
LARGE_BODY_BYTES = 256 * 1024
#: ``large`` is set in the thread of the large bodies (its long prompts go to a tokenizer
#: process of its own)
_lane = threading.local()
#: A prompt is refused unseen when it has more characters than this many times the
#: context times the vocabulary's longest token: no tokenization could make it fit
#: (the factor covers normalizers that merge characters).
_CHARS_MARGIN = 4

_REPLACEMENT = "\ufffd"
#: how SentencePiece vocabularies mark a token that starts a word (a space before it)
_WORD_START = "\u2581"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


_BYTE_LEVEL_DECODER = _byte_level_decoder()


#: characters of ``bad_words`` allowed per token of ``--max-token-ids`` before they are tokenized
_CHARS_PER_TOKEN_BOUND = 16


class ServerContext:
    """What the handlers share: the manager, the tokenizer and the metrics."""

    def __init__(
        self,
        manager: ServedEngine,
        tokenizer: Any,
        model_name: str,
        metrics: ServerMetrics,
        limits: ServerLimits,
        *,
        tool_parser: type[ToolCallParser] | None = None,
        reasoning: bool = False,
        harmony: bool = False,
        harmony_calls: bool = False,
    ) -> None:
        self.manager = manager
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.limits = limits
        #: the format tool calls are found in (None: requests with tools are refused)
        self.tool_parser = tool_parser
        #: whether ``<think>`` blocks become ``reasoning_content``
        self.reasoning = reasoning
        #: whether chat outputs are gpt-oss's harmony format (:mod:`aiocb.server.harmony`) ...
        self.harmony = harmony
        #: ... whose calls of the functions a request offers are tool calls (else tools are refused)
        self.harmony_calls = harmony_calls
        self.created = int(time.time())
        text_config = manager.model.config.get_text_config()
        #: the longest sequence a request may reach (the model's context, or the engine
        #: config's ``max_model_len``)
        self.max_model_len: int | None = served_context(text_config, manager.config.max_model_len)
        self.vocab_size: int = text_config.vocab_size
        longest_token = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars: int | None = (
            None if self.max_model_len is None else self.max_model_len * max(longest_token, 1) * _CHARS_MARGIN
        )
        #: the texts of the tokens a decode that skips special tokens leaves out
        self.special_texts: tuple[str, ...] = _special_texts(tokenizer)
        if harmony:  # (as for such a parser: the texts a harmony output's choices hide)
            HiddenTexts([text for text in self.special_texts if text not in HARMONY_MARKERS])
        if tool_parser is not None and tool_parser.needs_special_tokens:
            # The finders of the texts its choices hide (in the reasoning; in the content,
            # all but its marker), made now: Mistral's 768 control tokens take 9 ms.
            HiddenTexts(self.special_texts)
            HiddenTexts([text for text in self.special_texts if text != tool_parser.start])
        #: what a request that leaves a sampling field out gets
        self.defaults = served_defaults(manager.generation_config, text_config, tokenizer)
        #: set when the server begins to shut down: ``/ready`` answers 503 from then on
        self.draining = False
        #: whether the app's lifespan stops the manager at its end though it found it running
        #: (the server that runs the app started it first: see ``DrainingServer``)
        self.stops_engine = False
        self._token_texts: dict[int, str] = {}
        #: the tokenizer threads: for ordinary bodies (False) and large ones (True)
        self._executors: dict[bool, ThreadPoolExecutor] = {}
        #: where output constraints are built (:meth:`building`)
        self._builder: ThreadPoolExecutor | None = None
        #: where long prompts are tokenized: those of ordinary bodies, and those of large ones
        #: (in turn in each: a 7 MB prompt held a 100 KB one there for 9 s)
        self._processes = TokenizerProcessHolder(tokenizer)
        self._large_processes = TokenizerProcessHolder(tokenizer)
        self._template_variables = _template_variables(getattr(tokenizer, "chat_template", None))

    async def prepare(self, body: bytes, work: Callable[[bytes], T]) -> T:
        """``work(body)``: parsing and tokenizing a request, off the loop when the body is large.

        A tokenizer thread does it for the bodies of its size in turn (a long text is
        tokenized in a child process, :mod:`aiocb.tokenizer_process`); small bodies are
        cheaper than the hop.
        """
        return await self.off_loop(len(body), work, body)

    async def off_loop(self, size: int, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on the loop when ``size`` (bytes, characters or tokens) is small,
        else in a tokenizer thread (:meth:`in_thread`)."""
        if size <= INLINE_BODY_BYTES:
            return work(*args)
        return await self.in_thread(work, *args, large=size > LARGE_BODY_BYTES)

    async def in_thread(self, work: Callable[..., T], *args: Any, large: bool = False) -> T:
        """``work(*args)`` in a tokenizer thread, in turn with the other jobs there: that of
        the bodies over :data:`LARGE_BODY_BYTES` when ``large``, else the other. Jobs run
        in turn: a request with many prompts sends one job a few kilobytes of them, so
        that other requests' jobs come between."""
        executor = self._executors.get(large)
        if executor is None:
            name = "aiocb-tokenizer-large" if large else "aiocb-tokenizer"
            initializer = _mark_large_lane if large else None
            executor = self._executors[large] = ThreadPoolExecutor(1, name, initializer=initializer)
        job = partial(_large_work, work, *args) if large else partial(work, *args)
        return await asyncio.get_running_loop().run_in_executor(executor, job)

    async def building(self, work: Callable[[], T]) -> T:
        """``work()``, an output constraint's building (a JSON schema made a grammar: tens of
        milliseconds for a small one, seconds for an enum of thousands), on a thread of its
        own, one at a time: never ahead of a body's tokenizing, nor holding the threads
        that other work of the process shares."""
        if self._builder is None:
            self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiocb-constraints")
        return await asyncio.get_running_loop().run_in_executor(self._builder, pausing_call, work)

    def close(self) -> None:
        """Let the tokenizer and constraint threads and the tokenizer process go (at shutdown)."""
        for executor in (*self._executors.values(), self._builder):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
        self._executors.clear()
        self._builder = None
        self._processes.close()
        self._large_processes.close()

    def check_model(self, model: str | None) -> None:
        """A 404 unless ``model`` (when given) is the served model's name."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def check_choices(self, prompts: int, n: int) -> None:
        """Refuse a request for more choices than ``--max-choices`` allows or the engine's
        admission queue holds (:meth:`ServerLimits.check_choices`)."""
        self.limits.check_choices(prompts, n, self.manager.config.max_queue_size)

    def check_queued_tokens(self, prompt_lengths: Sequence[int]) -> None:
        """Refuse prompts (a request's, queued together) whose tokens add up to more than the
        engine's admission queue holds: the first always fits an empty queue, but the others
        never fit with it, so the request could never be taken (429 for ever)."""
        limit = self.manager.config.max_queued_tokens
        if limit and len(prompt_lengths) > 1 and sum(prompt_lengths) > limit:
            raise bad_request(
                f"the request's {len(prompt_lengths)} prompts have {sum(prompt_lengths)} tokens in all, more than "
                f"the engine's admission queue holds: {limit} (--max-queued-tokens)",
                "prompt",
            )

    def check_prompt_ids(self, ids: Sequence[int], param: str, where: str | None = None) -> None:
        """Refuse a token-id prompt longer than the context or with ids outside the model's
        vocabulary (checked here, off the loop for a large body, rather than by the engine).
        ``where`` names the prompt in the message (``prompt[3]``), ``param`` is the field."""
        where = where or param
        if self.max_model_len is not None and len(ids) > self.max_model_len:
            raise bad_request(
                f"{where} has {len(ids)} tokens, more than the model's context of {self.max_model_len}", param
            )
        if ids and max(ids) >= self.vocab_size:
            position = next(i for i, token in enumerate(ids) if token >= self.vocab_size)
            raise bad_request(
                f"{where}[{position}] = {ids[position]} is outside the model's vocabulary [0, {self.vocab_size})",
                param,
            )

    def check_prompt_chars(self, text: str, param: str, where: str | None = None) -> None:
        """Refuse, before tokenizing it, a prompt far too long for the context by its length alone."""
        bound = self.max_prompt_chars
        if bound is not None and len(text) > bound:
            raise bad_request(
                f"{where or 'the prompt'} has {len(text)} characters, which cannot fit the model's context of "
                f"{self.max_model_len} tokens",
                param,
            )

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (cached; special tokens included).

        A token that is only part of a UTF-8 character shows its bytes, as OpenAI does:
        ``"bytes:\\xe4\\xbd"``.
        """
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece.startswith(_WORD_START) and not text.startswith(" "):
                text = " " + text  # (a SentencePiece decoder strips the space a text starts with)
            if _REPLACEMENT in text:
                raw = self.token_bytes(token_id)
                if raw is not None:
                    text = "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
            self._token_texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token stands for, when the tokenizer says (byte-level BPE, byte fallback)."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        if all(char in _BYTE_LEVEL_DECODER for char in piece):
            return bytes(_BYTE_LEVEL_DECODER[char] for char in piece)
        return None

    def encode(self, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
        """All of ``text``'s token ids, however many (``/tokenize``): a long text's from the
        tokenizer process, whose answer becomes a list a slice at a time (thread-safe; a
        400 naming ``param`` when the text is not Unicode)."""
        return self._encoded(text, add_special_tokens, param, None, keep=None, limit=None).ids

    def encode_prompt(
        self, text: str, *, add_special_tokens: bool, param: str, where: str | None = None, keep: int | None = None
    ) -> Tokenized:
        """Token ids of a prompt to generate from: its last ``keep`` (``truncate_prompt_tokens``;
        -1: the context's length) or all of them, and how many the whole text made; a 400
        when the text is not Unicode, or when, uncut, it has more tokens than the context.

        A long text is tokenized in a child process (:mod:`aiocb.tokenizer_process`), whose
        answer holds only the tokens kept (thread-safe: the tokenizer thread calls this for
        large bodies).
        """
        limit = self.max_model_len
        tokenized = self._encoded(text, add_special_tokens, param, where, keep=keep, limit=limit)
        if keep is None and limit is not None and tokenized.total > limit:
            raise bad_request(
                f"{where or param} has {tokenized.total} tokens, more than the model's context of {limit}", param
            )
        return tokenized

    def _encoded(
        self, text: str, add_special_tokens: bool, param: str, where: str | None, *, keep: int | None, limit: int | None
    ) -> Tokenized:
        """:func:`encode_kept` with this server's tokenizer and its process; a 400 naming
        ``where`` (or ``param``) when the text is not one the tokenizer takes."""
        try:
            processes = self._large_processes if getattr(_lane, "large", False) else self._processes
            return encode_kept(
                text, self.tokenizer, processes, add_special_tokens=add_special_tokens, keep=keep, limit=limit
            )
        except (TypeError, ValueError) as exc:  # (UnicodeError is a ValueError)
            raise _untokenizable(where or param, param, exc) from None

    def with_bad_words(self, sampling: SamplingRequest) -> SamplingRequest:
        """``sampling`` with its ``bad_words`` as token sequences (``bad_words_ids``), made
        as vLLM makes them with this server's tokenizer."""
        if not sampling.bad_words:
            return sampling
        # Bounded by --max-token-ids: their characters before they are tokenized (a few a
        # token), their tokens after (each step matches every sequence against the output).
        bound = self.limits.max_token_ids
        chars = sum(map(len, sampling.bad_words))
        if bound and chars > _CHARS_PER_TOKEN_BOUND * bound:
            raise bad_request(
                f"'bad_words' hold {chars} characters; the server allows at most {_CHARS_PER_TOKEN_BOUND * bound} "
                f"({_CHARS_PER_TOKEN_BOUND} times --max-token-ids)",
                "bad_words",
            )
        try:
            sequences = bad_words_ids(sampling.bad_words, self.tokenizer)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), "bad_words") from None
        tokens = sum(map(len, sequences))
        if bound and tokens > bound:
            raise bad_request(
                f"'bad_words' make {tokens} tokens (each word alone and after a space); the server allows at "
                f"most {bound} (--max-token-ids)",
                "bad_words",
            )
        return dataclasses.replace(sampling, controls={**sampling.controls, "bad_words_ids": sequences})

    def char_offsets(self, text: str, num_tokens: int) -> list[int] | None:
        """Where each of the ``num_tokens`` tokens of ``text`` (special tokens added) starts
        in it; a token the tokenizer added (a BOS) starts where the next does. None when the
        tokenizer cannot say (a slow one)."""
        try:
            spans = self.tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)["offset_mapping"]
        except (NotImplementedError, TypeError, ValueError):
            return None
        return [start for start, _ in spans] if len(spans) == num_tokens else None

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``.

        A tokenizers-library tokenizer decodes through its batch call, which lets the GIL
        go while it works (its single call holds it: about 60 ms for 500,000 characters,
        all of it a stall of the event loop when this runs in the tokenizer thread); one
        that cleans up tokenization spaces decodes through transformers, which does that.
        """
        backend: Any = getattr(self.tokenizer, "_tokenizer", None)
        if hasattr(backend, "decode_batch") and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            texts: list[str] = backend.decode_batch([list(token_ids)], skip_special_tokens=skip_special_tokens)
            return texts[0]
        text: str = self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template applied to ``messages`` (and ``tools``); a 400 when it cannot be."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("the model's tokenizer has no chat template; use /v1/completions", "messages")
        self._check_template_kwargs(kwargs)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
        except Exception as exc:  # jinja2 errors, raise_exception() in templates
            raise bad_request(f"the chat template failed on these messages: {exc}", "messages") from exc
        if not isinstance(text, str):
            raise APIError(500, "the chat template did not render to text", type="internal_server_error")
        return text

    def _check_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Refuse ``chat_template_kwargs`` keys that are the template call's own arguments (a
        client's ``chat_template`` would run its own Jinja code here), and keys the model's
        template never reads (they would change nothing)."""
        for key in kwargs:
            if key in _TEMPLATE_CALL_ARGUMENTS:
                why = _OWN_FIELDS.get(key, "the server's template call sets it")
                raise bad_request(f"'chat_template_kwargs' may not set {key!r}: {why}", "chat_template_kwargs")
            if self._template_variables is not None and key not in self._template_variables:
                raise bad_request(
                    f"'chat_template_kwargs' sets {key!r}, which this model's chat template does not use",
                    "chat_template_kwargs",
                )

    def cache_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds (an estimate, for default ``max_tokens``)."""
        return self.manager.statistics().capacity_tokens

    def min_tokens(self, sampling: SamplingRequest, prompt_len: int) -> int:
        """A choice's ``min_tokens``: the request's, else what the engine takes from the
        model's generation config (before which no stop string may end the text either)."""
        if sampling.min_tokens is not None:
            return sampling.min_tokens
        return config_min_tokens(self.defaults.min_new_tokens, self.defaults.min_length, prompt_len)

    def config_max_tokens(self, prompt_len: int, param: str, min_tokens: int | None) -> int | None:
        """What the model's generation config caps a request's default ``max_tokens`` at: its
        ``max_new_tokens``, else its ``max_length`` less the prompt (None: neither is set). A
        400 naming ``param`` (the prompt's field) where its ``max_length`` leaves no room and
        the request's ``min_tokens`` (which the cap gives way to) asks for none."""
        if self.defaults.max_new_tokens is not None:
            return self.defaults.max_new_tokens
        if self.defaults.max_length is None:
            return None
        if prompt_len >= self.defaults.max_length and not min_tokens:
            raise bad_request(
                f"the prompt ({prompt_len} tokens) leaves no room under the model's generation config's "
                f"max_length ({self.defaults.max_length}, which counts the prompt); give max_tokens",
                param,
            )
        return max(self.defaults.max_length - prompt_len, 0)

    def default_max_tokens(self, prompt_len: int, min_tokens: int | None) -> int:
        """``max_tokens`` when a chat request does not say: what the context and the cache
        leave, at most what the model's generation config caps it at (:meth:`config_max_tokens`).
        A 400 naming ``messages`` when they leave no room for a reply."""
        capacity = self.cache_capacity_tokens()
        if self.max_model_len is not None and prompt_len >= self.max_model_len:
            raise bad_request(
                f"the conversation ({prompt_len} tokens) leaves no room for a reply in the model's context "
                f"length of {self.max_model_len}",
                "messages",
            )
        if prompt_len > capacity:
            raise bad_request(
                f"the conversation ({prompt_len} tokens) leaves no room for a reply in the KV cache "
                f"({capacity} tokens)",
                "messages",
            )
        room = capacity - prompt_len + 1  # (the last token is sampled, never attended to: no slot)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - prompt_len)
        capped = self.config_max_tokens(prompt_len, "messages", min_tokens)
        if capped is not None:
            room = min(room, capped)
        return max(room, 1)


#: ``apply_chat_template``'s own arguments that a request may not set through
#: ``chat_template_kwargs`` (``documents`` and ``continue_final_message`` it may: what a
#: template reads, and how the call renders the last message).
_TEMPLATE_CALL_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "chat_template",
        "add_generation_prompt",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


#: Template call arguments that a chat body gives as fields of its own.
_OWN_FIELDS = {"tools": "give tools as 'tools'", "add_generation_prompt": "give it as 'add_generation_prompt'"}


#: The fields of a model's generation config that fill a request's left-out ones (vLLM's
#: server takes the same; the others apply in the engine, as with ``model.generate``).
_SERVED_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens")


def served_defaults(generation_config: Any, model_config: Any, tokenizer: Any) -> ServedDefaults:
    """What a request that leaves a sampling field out gets from the served model's
    ``generation_config``: the fields of :data:`_SERVED_FIELDS` it sets (differing from
    transformers' defaults; as vLLM's server), else OpenAI's; and the EOS ids with the
    tokenizer's EOS, where the model's (its generation config's, else its config's) lack it
    (a fine-tune whose tokenizer ends turns with a token its generation config never named)."""
    given = generation_config.to_diff_dict() if generation_config is not None else {}
    fields: dict[str, Any] = {name: given[name] for name in _SERVED_FIELDS if given.get(name) is not None}
    if "max_new_tokens" not in fields and given.get("max_length") is not None:
        fields["max_length"] = given["max_length"]  # (as generate: max_new_tokens, where set, wins)
    sampling = sorted(name for name in ("temperature", "top_p", "top_k") if name in fields)
    if sampling and not given.get("do_sample"):
        # (vLLM's server reads these without do_sample too; model.generate would be greedy)
        logger.warning(
            "the model's generation config sets %s with do_sample false: a request that leaves them out "
            "is sampled with them (as vLLM's server does); send temperature 0 for greedy decoding",
            ", ".join(sampling),
        )
    if "top_k" in fields:
        fields["top_k"] = max(int(fields["top_k"]), 0)
    model_eos = eos_ids(getattr(generation_config, "eos_token_id", None)) or eos_ids(
        getattr(model_config, "eos_token_id", None)
    )
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tokenizer_eos, int) and tokenizer_eos >= 0 and tokenizer_eos not in model_eos:
        fields["eos_token_ids"] = tuple(sorted(model_eos | {tokenizer_eos}))
    fields["min_new_tokens"] = getattr(generation_config, "min_new_tokens", None)
    fields["min_length"] = getattr(generation_config, "min_length", None)
    return ServedDefaults(**fields)


def _template_variables(template: Any) -> frozenset[str] | None:
    """The variables a chat template reads (``documents`` among them where it reads them),
    and ``continue_final_message`` (which the template call takes); None when that cannot
    be told (no template, several named ones, a template transformers' Jinja setup does
    not parse)."""
    if not isinstance(template, str):
        return None
    try:
        import jinja2.meta
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(template).environment
        variables = jinja2.meta.find_undeclared_variables(environment.parse(template))
    except Exception:  # (a private helper of transformers: any failure means "cannot tell")
        return None
    return frozenset(variables) | {"continue_final_message"}


def _mark_large_lane() -> None:
    _lane.large = True


def _large_work(work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` for a large body: with no full collection in the middle (each would
    walk its millions of small values: :func:`~aiocb.collector.full_collections_deferred`),
    and the GIL handed to the threads that wait for it within half a millisecond (the
    template's rendering cannot pause: :func:`~aiocb.gil.switching_often`)."""
    with full_collections_deferred(), switching_often():
        return work(*args)


def finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf becomes -9999.0 (as vLLM does)."""
    return logprob if logprob > -9999.0 else -9999.0


def _untokenizable(where: str, param: str, exc: Exception) -> APIError:
    # A lone UTF-16 surrogate ("\ud800") is valid JSON but no Unicode text.
    return bad_request(f"{where} cannot be tokenized (is it valid Unicode text?): {exc}", param)


def _special_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts of ``tokenizer``'s special tokens: those it names, and every added token
    marked special (a chat template's ``<|im_end|>`` often is one and not the other)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    texts = {*getattr(tokenizer, "all_special_tokens", ()), *(t.content for t in added if t.special)}
    return tuple(sorted(texts))
