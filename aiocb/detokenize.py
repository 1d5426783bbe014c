"""Text from a growing list of token ids, and stop strings found in it.

:class:`IncrementalDetokenizer` turns each new token into the text it adds. A token that
ends inside a multi-byte character (byte-level BPE splits UTF-8 freely) adds nothing until
the character is complete (or, where stop strings are looked for, the characters before
it at once), so a delta never carries half a character or a stray U+FFFD.
With a fast (``tokenizers``) tokenizer it is the library's own ``DecodeStream``, one call
into Rust per token; with any other tokenizer it decodes a small window of recent tokens
(the same "offsets" method), so the cost of a token never grows with the output.

:class:`StopStringMatcher` finds stop strings in that text as it grows. Text that could be
the start of a stop string is held back until it is known not to be one; when a stop
string is found, the text before it is released and the stop string itself is dropped.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from aiocb.stop_strings import distinct, stop_strings

#: Prompt tokens decoded with the first generated ones, so that a tokenizer that drops a
#: leading space at the start of a text (SentencePiece) puts it back where it belongs ...
_CONTEXT_TOKENS = 5
#: ... or more, up to this many, so that they start on a character: a byte-fallback
#: decoder (Llama 2, Mistral, Gemma) turns a whole run of byte tokens that starts inside a
#: character into U+FFFD, the new tokens' bytes with it.
_MAX_CONTEXT_TOKENS = 24
#: Tokens held without text beyond which what can no longer change is released: more than
#: the bytes of any character still incomplete (stray continuation bytes, a run of skipped
#: special tokens), which would otherwise be held, and decoded again, at every new token ...
_MAX_HELD = 4
#: ... and beyond which all is, as it decodes (bytes no character can take, which decode to
#: U+FFFD, as a character still incomplete may; a character left incomplete among skipped
#: tokens).
_MAX_HELD_AT_ALL = 16
#: The held tokens a release may keep: the bytes of a character still incomplete, at most.
_INCOMPLETE = 3
_REPLACEMENT = "\ufffd"


def _stream_backend(tokenizer: Any) -> Tokenizer | None:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` (whose decode is
    ``tokenizer.decode``'s without the clean-up of tokenization spaces), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


#: :func:`_vocabulary_facts` of each tokenizer, with the vocabulary size they were found at
_FACTS: weakref.WeakKeyDictionary[Any, tuple[int, dict[int, int], frozenset[int]]] = weakref.WeakKeyDictionary()


def _vocabulary_facts(tokenizer: Any) -> tuple[dict[int, int], frozenset[int]]:
    """A tokenizer's byte tokens (``<0xE4>``) by id with their bytes (a byte-fallback one's;
    empty for any other), and the ids a decode that skips special tokens leaves out. Found
    once a tokenizer (256 lookups and the added tokens: some 0.2 ms; found for every request
    they held the loop in slices of milliseconds), again if its vocabulary grows."""
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else -1
    known = _FACTS.get(tokenizer)
    if known is not None and known[0] == size:
        return known[1], known[2]
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    found: dict[int, int] = {}
    if convert is not None:
        for byte in range(256):
            token = convert(f"<0x{byte:02X}>")
            if isinstance(token, int) and token != getattr(tokenizer, "unk_token_id", None):
                found[token] = byte
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        added = backend.get_added_tokens_decoder()
        skipped = frozenset(token for token, added_token in added.items() if added_token.special)
    else:
        skipped = frozenset(getattr(tokenizer, "all_special_ids", ()))
    facts = (found if len(found) == 256 else {}, skipped)
    with contextlib.suppress(TypeError):  # (a tokenizer that takes no weak reference: found each time)
        _FACTS[tokenizer] = (size, *facts)
    return facts


class IncrementalDetokenizer:
    """Text deltas for token ids added one by one.

    ``context_ids`` (the prompt) are decoded with the first tokens but never emitted. The
    concatenated deltas, with :meth:`flush` at the end, equal ``tokenizer.decode`` of the
    added ids where their bytes are valid UTF-8, without its clean-up of tokenization
    spaces (``clean_up_tokenization_spaces``: a stream cannot take back the space before a
    ``"."`` that comes later; nor does vLLM's text clean up). Where a byte-fallback
    tokenizer's (Llama 2, Mistral, Gemma) run of byte tokens is not, its decoder turns the
    whole run into U+FFFD, bytes already streamed as characters among them; the deltas
    keep those as they were sent (as vLLM's do), and held bytes give one U+FFFD each. A
    character that the context leaves incomplete is left out of it: the added tokens that
    would end it decode as they do alone. Tokens held
    without text (bytes of a character not yet complete, skipped special tokens) are
    decoded again with each new one, so at most a few are: bytes that can no longer make a
    character come out as U+FFFD at once, not at the end (in a byte-fallback run that is
    not valid, characters the run's later bytes make may then come out as themselves,
    where the decoder gives the whole run as U+FFFD). With ``release_ahead`` (for stop
    strings: they then end in the token whose text ends them), a held token's text before
    its incomplete last character (byte-level BPE: ``"a"`` and the first byte of ``"ñ"``)
    is released with it, not with the token that completes the character; it costs a
    decode per held token.
    """

    def __init__(
        self,
        tokenizer: Any,
        context_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        release_ahead: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._release_ahead = release_ahead
        self._backend = _stream_backend(tokenizer)
        context = self._context(context_ids)
        self._stream = self._new_stream(self._backend, context) if self._backend else None
        # The window of the offsets method; with a stream, only what flush() needs: the
        # last tokens that produced text, then the ones still held.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        #: the text of held tokens released ahead of them (see :meth:`add`)
        self._ahead = ""
        self._ahead_ok = False
        #: the ids a decode skips, when releasing ahead is possible (None: not looked up yet)
        self._ahead_skipped: frozenset[int] | None = None
        self._prefix_cache: tuple[tuple[int, ...], str] | None = None
        #: characters of text emitted so far (not counting the context)
        self.num_chars = 0
        #: where, in those characters, the text of the token last added starts (see :meth:`add`)
        self.last_start = 0

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes (often all of its own text, maybe "").

        :attr:`last_start` is then where its own text starts. That is after the characters
        of tokens held before it that come out with it: a character they made before the
        one it completes, the U+FFFD of bytes that no character took. A character split
        between them and it starts where it starts."""
        before = self.num_chars
        if self._read_offset == len(self._ids):  # (nothing held: the usual case)
            text = self._add_text(token_id)
            self.last_start = before
            return text
        theirs = self._held_text()[len(self._ahead) :]
        text = self._add_text(token_id)
        # (the held tokens' text ends where theirs and this token's part: at a split
        # character's U+FFFD, which the text then does not have)
        shared = next((i for i, (a, b) in enumerate(zip(text, theirs, strict=False)) if a != b), None)
        self.last_start = before + (min(len(text), len(theirs)) if shared is None else shared)
        return text

    def _held_text(self) -> str:
        """The text the held tokens give now, decoded in the window (a byte-fallback
        decoder's run of bytes that is not valid: one U+FFFD a byte, where a byte decoded
        alone may be a character)."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self._ids))
        if not text.startswith(prefix):
            # (a byte-fallback decoder turned the window's run of bytes, its last text among
            # them, into U+FFFD with the held ones: they are decoded alone, as in _release)
            return self._decode(self._read_offset, len(self._ids))
        return text[len(prefix) :]

    def _add_text(self, token_id: int) -> str:
        """:meth:`add`'s text."""
        text = self._less_ahead(self._add(token_id))
        if self._release_ahead and self._read_offset < len(self._ids) and self._releases_ahead(token_id):
            # Tokens held: the characters they complete before the incomplete last one are
            # released ahead of them (a stop string in them then ends in the token that
            # gave them). A byte-level decoder decodes UTF-8, invalid bytes as U+FFFD: the
            # characters before an incomplete one never change. A byte-fallback decoder's
            # may (a run of bytes that is not valid becomes U+FFFD, all of it).
            held = self._decode(self._prefix_offset, len(self._ids)).rstrip(_REPLACEMENT)
            prefix = self._prefix_text()
            if held.startswith(prefix) and len(held) > len(prefix) + len(self._ahead):
                early = held[len(prefix) + len(self._ahead) :]
                self._ahead += early
                self.num_chars += len(early)
                text += early
        return text

    def _releases_ahead(self, token_id: int) -> bool:
        """Whether the held tokens, ``token_id`` the last, may have characters to release
        ahead: not after a skipped special token (no text), nor with a byte-fallback
        tokenizer (both found once, at the first held token)."""
        if self._ahead_skipped is None:
            self._ahead_skipped = frozenset() if self._byte_tokens() else self._skipped_ids()
            self._ahead_ok = not self._byte_tokens()
        return self._ahead_ok and not (self._skip_special and token_id in self._ahead_skipped)

    def _prefix_text(self) -> str:
        """The text of the window's last tokens with text (the held ones' context), decoded
        once while they stay the same."""
        key = tuple(self._ids[self._prefix_offset : self._read_offset])
        if self._prefix_cache is None or self._prefix_cache[0] != key:
            self._prefix_cache = (key, self._decode_ids(list(key)))
        return self._prefix_cache[1]

    def _less_ahead(self, text: str) -> str:
        """``text``, released for held tokens, less what was released ahead of them."""
        if not self._ahead:
            return text
        ahead, self._ahead = self._ahead, self._ahead[len(text) :]
        self.num_chars -= min(len(text), len(ahead))  # (counted once, when released ahead)
        return text[len(ahead) :]

    def _add(self, token_id: int) -> str:
        """:meth:`add` without the text released ahead."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, token_id)  # type: ignore[arg-type]  # set with the stream
            except Exception:  # (the library's own error type is not exported)
                # "Invalid prefix encountered": the new token changed text already emitted
                # (a byte-fallback decoder turned a run of bytes into U+FFFD, say). The
                # window method takes over, from the tokens after the last text, which it
                # never looks back past, until the held tokens give text.
                self._stream = None
                self._prefix_offset = self._read_offset
                return self._window_delta()
            if not text:  # a special token skipped, or a character still incomplete
                if len(self._ids) - self._read_offset <= _MAX_HELD:
                    return ""
                self._stream = None  # (the window method releases what can no longer change)
                return self._window_delta()
            self._advance()
            self.num_chars += len(text)
            return text
        return self._window_delta()

    def _window_delta(self) -> str:
        """The offsets method: the text the window's new tokens add to its last text; when
        more than :data:`_MAX_HELD` tokens are held, the text of those that can no longer
        change (:meth:`_release`)."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self._ids))
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return "" if len(self._ids) - self._read_offset <= _MAX_HELD else self._release(prefix, text)
        delta = text[len(prefix) :] if text.startswith(prefix) else self._decode(self._read_offset, len(self._ids))
        self._advance()
        self.num_chars += len(delta)
        if self._backend is not None and self._stream is None:
            # (nothing held: the decode stream, some 5x cheaper a token, takes over again)
            self._stream = self._new_stream(self._backend, self._context(self._ids))
        return delta

    def _release(self, prefix: str, text: str) -> str:
        """The text of the held tokens up to where it can be cut, the last ones still held: at
        a byte-fallback byte token that starts a character, or where, decoded in two parts,
        it is the same (no character split) and the part released does not end in U+FFFD;
        nothing while there is no such cut, unless more than :data:`_MAX_HELD_AT_ALL` are
        held: then up to a cut that splits no character, else all, as they decode. Skipped
        special tokens are dropped, and so are tokens released
        without text, the window's last text kept as its start (a SentencePiece decoder
        strips the space of a first word: after skipped special tokens, it did)."""
        start, end = self._read_offset, len(self._ids)
        base = self._prefix_offset  # (``prefix`` and ``text``: the window's, from it)
        if self._skip_special:  # (skipped tokens decode to nothing wherever they are: dropped)
            skipped = self._skipped_ids()
            kept = [token for token in self._ids[start:] if token not in skipped]
            if len(kept) < end - start:
                self._ids[start:] = kept
                end = len(self._ids)
                if end - start <= _MAX_HELD:
                    return ""
        if not text.startswith(prefix):
            # (a byte-fallback decoder turned the window's run of bytes, its last text among
            # them, into U+FFFD with the held ones: the held tokens are decoded alone)
            base, prefix, text = start, "", self._decode(start, end)
        held = text[len(prefix) :]
        # The last cut (keeping the fewest held) where a character starts: told by its byte
        # for a byte token; for another, by the two parts adding up to the whole (one that
        # splits a character decodes differently) and the first not ending in U+FFFD,
        # which may split one too (a byte-fallback decoder gives a run of bytes that ends
        # inside a character one U+FFFD a byte, and the run cut there the same), unless
        # more than _MAX_HELD_AT_ALL are held.
        patient = end - start <= _MAX_HELD_AT_ALL
        byte_of = self._byte_tokens()
        for cut in range(end - 1, end - _INCOMPLETE - 1, -1):
            # (a byte-fallback byte token: a character starts there unless it continues one)
            byte = byte_of.get(self._ids[cut]) if byte_of else None
            if byte is not None and 0x80 <= byte < 0xC0:
                continue
            head = self._decode(base, cut)
            released = head[len(prefix) :]
            if head.startswith(prefix) and (
                byte is not None
                or (not (patient and released.endswith(_REPLACEMENT)) and head + self._decode(cut, end) == text)
            ):
                held, end = released, cut
                break
        else:
            if patient:
                return ""
        if held:
            self._advance(end)
            self.num_chars += len(held)
        else:
            del self._ids[start:end]
        return held

    def _byte_tokens(self) -> dict[int, int]:
        """A byte-fallback tokenizer's byte tokens (``<0xE4>``), by id, and their bytes;
        empty for any other."""
        return _vocabulary_facts(self._tokenizer)[0]

    def _skipped_ids(self) -> frozenset[int]:
        """The ids a decode that skips special tokens leaves out."""
        return _vocabulary_facts(self._tokenizer)[1]

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Append several tokens; returns the text they complete."""
        return "".join(self.add(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """The text of tokens still held (an incomplete character at the very end), as it decodes."""
        return self._less_ahead(self._flush())

    def _flush(self) -> str:
        """:meth:`flush` without the text released ahead."""
        if self._read_offset == len(self._ids):
            return ""
        delta = self._held_text()
        # The held tokens are spent: a later token starts after them, as with a decode (by
        # either method: the window too starts again, after the same context).
        context = self._context(self._ids)
        self._ids, self._prefix_offset, self._read_offset = context, 0, len(context)
        if self._stream is not None and self._backend is not None:
            self._stream = self._new_stream(self._backend, context)
        self.num_chars += len(delta)
        return delta

    def _context(self, ids: Sequence[int]) -> list[int]:
        """The last tokens of ``ids`` that new ones are decoded after: the shortest suffix of
        at least :data:`_CONTEXT_TOKENS` tokens, of at most :data:`_MAX_CONTEXT_TOKENS`, whose
        text starts on a character (has no U+FFFD: one that starts inside a character decodes
        its first bytes as U+FFFD, and a byte-fallback decoder its whole run of bytes); and
        that ends on one: the tokens of a character ``ids`` leave incomplete are left out (the
        new tokens that end it then decode as they do alone, rather than changing text
        already decoded)."""
        ids = list(ids[-(_MAX_CONTEXT_TOKENS + _MAX_HELD) :])
        if (
            len(ids) > _CONTEXT_TOKENS
            and _REPLACEMENT not in (text := self._decode_ids(ids[-_CONTEXT_TOKENS:]))
            and text
        ):
            return ids[-_CONTEXT_TOKENS:]  # (the usual case, in one decode)
        for held in range(min(_MAX_HELD, len(ids) + 1)):  # (all of them: a context of one incomplete character)
            if not self._decode_ids(ids[: len(ids) - held]).endswith(_REPLACEMENT):
                del ids[len(ids) - held :]
                break
        if len(ids) <= _CONTEXT_TOKENS:
            return ids
        sizes = range(_CONTEXT_TOKENS, min(len(ids), _MAX_CONTEXT_TOKENS) + 1)
        texts: list[str] = []
        for size in sizes:
            text = self._decode_ids(ids[-size:])
            if text and _REPLACEMENT not in text:  # (no text: skipped special tokens alone)
                return ids[-size:]
            texts.append(text)
        # Text with U+FFFD of its own: the shortest with text whose tokens before it, in the
        # longest, decode to the rest of the longest's text (a suffix that starts inside a
        # character decodes its first bytes, or its whole run of bytes, as U+FFFD instead).
        longest = texts[-1]
        for size, text in zip(sizes, texts, strict=True):
            head = self._decode_ids(ids[-sizes[-1] : -size]) if size < sizes[-1] else ""
            if text and longest in (head + text, f"{head} {text}"):  # (a first word's space stripped)
                return ids[-size:]
        return ids[-_CONTEXT_TOKENS:]

    def _new_stream(self, backend: Tokenizer, context: list[int]) -> DecodeStream | None:
        """A stream that has decoded ``context`` and will emit only what follows it; None
        when ``context`` ends inside a character (the stream would emit its bytes later)."""
        stream = DecodeStream(skip_special_tokens=self._skip_special)
        if context and stream.step(backend, context) is None and self._decode_ids(context):
            return None
        return stream

    def _advance(self, end: int | None = None) -> None:
        """The tokens up to ``end`` (all, by default) have given their text."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids) if end is None else end
        if self._prefix_offset > 64:  # keep the window small
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _decode(self, start: int, end: int) -> str:
        return self._decode_ids(self._ids[start:end]) if start < end else ""

    def _decode_ids(self, ids: list[int]) -> str:
        if self._backend is not None:  # (what tokenizer.decode gives, without its Python layers)
            return self._backend.decode(ids, skip_special_tokens=self._skip_special)
        if getattr(self._tokenizer, "clean_up_tokenization_spaces", False):
            text: str = self._tokenizer.decode(
                ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
            )
        else:
            text = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
        return text


class StopStringMatcher:
    """Holds back text that may begin a stop string; trims the stop string when it appears.

    A stop string counts only where it ends in the text of a token after the first
    ``min_tokens`` (it may begin earlier, as vLLM's does). Of those ending in one piece of
    text, the one that begins first is found (the first given of those that begin there).
    The stop string found is dropped from the released text unless ``include``; text
    after it always is.
    """

    def __init__(self, stop: Sequence[str], *, min_tokens: int = 0, include: bool = False) -> None:
        stops = distinct(stop)
        self._automaton = stop_strings(stops) if stops else None
        self._min_tokens = min_tokens
        self._include = include
        self._held = ""
        #: the automaton's state: the held text is its end that may begin a stop string
        self._node = 0
        #: the stop string that was found, once one was
        self.matched: str | None = None

    @property
    def held(self) -> str:
        """Text received but not released yet."""
        return self._held

    def feed(self, text: str, num_output_tokens: int | None = None) -> str:
        """Add the text of the ``num_output_tokens``-th generated token (None: the text
        left at the end); returns what can be released now.

        After a stop string is found (:attr:`matched` is set), returns the text before it
        and ignores everything fed later.
        """
        automaton = self._automaton
        if automaton is None or self.matched is not None:
            return "" if self.matched is not None else text
        count = num_output_tokens is None or num_output_tokens > self._min_tokens
        node, begins, which = automaton.scan(self._node, text, len(self._held), count)
        buffer = self._held + text
        if which >= 0:
            self.matched = stop = automaton.stops[which]
            self._held = ""
            return buffer[: begins + len(stop)] if self._include else buffer[:begins]
        while automaton.depth(node) >= automaton.longest:  # (the longest, found in early text)
            node = automaton.shorter(node)
        self._node = node
        keep = automaton.depth(node)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release the held text (the output ended without completing a stop string)."""
        held, self._held = self._held, ""
        self._node = 0
        return "" if self.matched is not None else held


def _prompt_tail(tokenizer: Any, prompt_ids: Sequence[int], stops: tuple[str, ...]) -> str:
    """The end of the prompt's text (special tokens written) that a stop string completed
    by a generated token could begin in: its longest's length less one character."""
    keep = max(map(len, stops), default=1) - 1
    if not keep or not prompt_ids:
        return ""
    # (a character may take up to four byte-level tokens: enough are decoded for ``keep``
    # whole ones after a first one cut)
    text = tokenizer.decode(list(prompt_ids[-(4 * keep + 4) :]), skip_special_tokens=False)
    return str(text)[-keep:]


class TextTracker:
    """A request's generated text as its tokens arrive, and the stop string that ended it
    (see :class:`StopStringMatcher` for ``stop``, ``min_tokens`` and ``include_stop_str``).

    ``config_stop`` are stop strings with transformers' rules (a ``GenerationConfig``'s
    ``stop_strings``): found in the text with special tokens (a chat model's
    ``"<|im_end|>"``), from the first token on, and the text of every token kept; one may
    begin in the prompt, as long as it ends in a generated token.
    """

    __slots__ = ("_config_stop", "_detokenizer", "_matcher", "_parts", "_seen", "_special_text", "matched")

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        include_stop_str: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        config_stop: Sequence[str] = (),
    ) -> None:
        self._config_stop = tuple(dict.fromkeys(s for s in config_stop if s))
        # (released ahead for any stop string: one ends in the token whose text ends it, not
        # in a later one that completes a character the token begins)
        self._detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_ids,
            skip_special_tokens=skip_special_tokens,
            release_ahead=bool(stop or self._config_stop),
        )
        self._matcher = StopStringMatcher(stop, min_tokens=min_tokens, include=include_stop_str) if stop else None
        #: the text with special tokens, where the released text skips them
        self._special_text = (
            IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=False, release_ahead=True)
            if self._config_stop and skip_special_tokens
            else None
        )
        #: the end of that text a config stop string could begin in (the prompt's at first)
        self._seen = _prompt_tail(tokenizer, prompt_ids, self._config_stop)
        self._parts: list[str] = []
        #: the stop string found, once one was
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """The text released so far."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, token_id: int, num_output_tokens: int, *, last: bool = False) -> str | None:
        """Add the ``num_output_tokens``-th generated token; returns the stop string it
        completes, if any. ``last``: the token ends the output (a stop token whose text is
        kept), which a stop string in its text does not take from it: the text held and
        its own are released whole."""
        if self.matched is not None:
            return None
        piece = self._detokenizer.add(token_id)
        if last:
            piece += self._detokenizer.flush()
            self._parts.append(piece if self._matcher is None else self._matcher.flush() + piece)
            return None
        self._release(piece, num_output_tokens)
        if self._config_stop and self.matched is None:
            self._watch(piece if self._special_text is None else self._special_text.add(token_id))
        return self.matched

    def finish(self) -> None:
        """The request ended: release the text still held (an incomplete character, a
        possible stop string's beginning; all of it after a config stop string)."""
        if self._matcher is not None and self._matcher.matched is not None:
            return
        self._release(self._detokenizer.flush(), None)
        if self._matcher is not None and self._matcher.matched is None:
            self._parts.append(self._matcher.flush())

    def _watch(self, piece: str) -> None:
        """Look for a config stop string in the text with special tokens, ``piece`` new."""
        seen = self._seen + piece
        before = len(self._seen)  # (a match ends in the new piece: one before it was seen then, or is the prompt's)
        found = [
            (at, stop) for stop in self._config_stop if (at := seen.find(stop, max(0, before - len(stop) + 1))) >= 0
        ]
        if found:
            self.matched = min(found)[1]
        else:
            keep = max(map(len, self._config_stop)) - 1  # (a stop string may begin there)
            self._seen = seen[max(0, len(seen) - keep) :]

    def _release(self, piece: str, num_output_tokens: int | None) -> None:
        matcher = self._matcher
        released = piece if matcher is None else matcher.feed(piece, num_output_tokens)
        if released:
            self._parts.append(released)
        if matcher is not None and matcher.matched is not None:
            self.matched = matcher.matched
