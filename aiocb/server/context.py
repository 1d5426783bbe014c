"""What the request handlers share: the manager, the tokenizer, the metrics, and token texts."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

from aiocb.engine.manager import Manager
from aiocb.server.metrics import ServerMetrics
from aiocb.server.protocol import APIError, bad_request

_REPLACEMENT = "\ufffd"
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


class ServerContext:
    """What the handlers share: the manager, the tokenizer and the metrics."""

    def __init__(self, manager: Manager, tokenizer: Any, model_name: str, metrics: ServerMetrics) -> None:
        self.manager = manager
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.created = int(time.time())
        text_config = manager.model.config.get_text_config()
        self.max_model_len: int | None = getattr(text_config, "max_position_embeddings", None)
        self._token_texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (cached; special tokens included).

        A token that is only part of a UTF-8 character shows its bytes, as OpenAI does:
        ``"bytes:\\xe4\\xbd"``.
        """
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
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

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids``."""
        text: str = self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, kwargs: dict[str, Any]
    ) -> str:
        """The chat template applied to ``messages``; a 400 when it cannot be."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("the model's tokenizer has no chat template; use /v1/completions", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
        except Exception as exc:  # jinja2 errors, raise_exception() in templates
            raise bad_request(f"the chat template failed on these messages: {exc}", "messages") from exc
        if not isinstance(text, str):
            raise APIError(500, "the chat template did not render to text", type="internal_server_error")
        return text

    def cache_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds (an estimate, for default ``max_tokens``)."""
        return self.manager.statistics().total_blocks * self.manager.config.page_size

    def default_max_tokens(self, prompt_len: int) -> int:
        """``max_tokens`` when a chat request does not say: what the context and the cache leave."""
        room = self.cache_capacity_tokens() - prompt_len
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - prompt_len)
        return max(room, 1)


def finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf becomes -9999.0 (as vLLM does)."""
    return logprob if logprob > -9999.0 else -9999.0
