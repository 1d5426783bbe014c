"""Incremental detokenization and stop strings, on the byte-level BPE test tokenizer and a
SentencePiece-style one with byte fallback."""

from __future__ import annotations

import random
from typing import Any

import pytest

from aiocb.detokenize import IncrementalDetokenizer, StopStringMatcher, TextTracker
from tests.server.conftest import DecodeOnly, build_byte_fallback_tokenizer

TEXTS = [
    "Héllo wörld, naïve café!",
    "你好，世界！今天天气很好。",
    "Emoji: 😀 🚀 🌍 ✨ 👍🏽 ❤️ 🇫🇷 and more 🚀🚀",
    "Привет, мир! Как дела?",
    "def add(a, b):\n    return a + b\n",
]


@pytest.mark.parametrize("ahead", [False, True], ids=["", "ahead"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_the_text_and_never_split_a_character(tokenizer: Any, text: str, ahead: bool) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, release_ahead=ahead)
    deltas = [detokenizer.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detokenizer.flush() == text
    assert detokenizer.num_chars == len(text)


def test_the_tokenizer_splits_characters_across_tokens(tokenizer: Any) -> None:
    # Otherwise the test above would prove nothing.
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_context_tokens_are_not_repeated(tokenizer: Any) -> None:
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
    completion = tokenizer.encode(" there lived an old fisherman 🐟", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detokenizer.add(i) for i in completion) + detokenizer.flush()
    assert text == " there lived an old fisherman 🐟"


@pytest.mark.parametrize("ahead", [False, True], ids=["", "ahead"])
def test_random_ids_match_a_full_decode(tokenizer: Any, ahead: bool) -> None:
    # Random ids make invalid UTF-8 too: deltas still add up to what decode() gives.
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(1, 60))]
        detokenizer = IncrementalDetokenizer(tokenizer, release_ahead=ahead)
        text = "".join(detokenizer.add(i) for i in ids) + detokenizer.flush()
        assert text == tokenizer.decode(ids)


def test_special_tokens_are_skipped_or_kept(tokenizer: Any) -> None:
    ids = [*tokenizer.encode("Paris.", add_special_tokens=False), tokenizer.eos_token_id]
    skipping = IncrementalDetokenizer(tokenizer)
    assert skipping.add_many(ids) + skipping.flush() == "Paris."
    keeping = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert keeping.add_many(ids) + keeping.flush() == "Paris.<|endoftext|>"


def test_long_outputs_keep_a_small_window(tokenizer: Any) -> None:
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add_many(ids) == tokenizer.decode(ids)
    assert len(detokenizer._ids) < 80


def _feed(stop: list[str], pieces: list[str]) -> tuple[list[str], str | None, str]:
    matcher = StopStringMatcher(stop)
    released = [matcher.feed(p) for p in pieces]
    return released, matcher.matched, matcher.flush()


def test_stop_string_is_trimmed_across_pieces() -> None:
    released, matched, tail = _feed(["Answer:"], ["The ", "capital. An", "swer", ": Paris"])
    assert "".join(released) == "The capital. "
    assert matched == "Answer:"
    assert tail == ""
    assert released[1] == "capital. "  # "An" is held back: it may start "Answer:"


def test_held_text_is_released_when_it_is_not_a_stop() -> None:
    released, matched, tail = _feed(["\n\n"], ["line one\n", "line two\n"])
    assert matched is None
    assert released == ["line one", "\nline two"]
    assert tail == "\n"


def test_the_earliest_stop_string_wins() -> None:
    released, matched, _ = _feed(["world", "lo w"], ["hello world"])
    assert matched == "lo w"
    assert released == ["hel"]


def test_stop_inside_one_piece_and_nothing_after_a_match() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abcSTOPdef") == "abc"
    assert matcher.feed("more") == ""
    assert matcher.flush() == ""


def test_a_stop_string_may_begin_in_the_first_min_tokens_but_not_end_there() -> None:
    matcher = StopStringMatcher(["ab", "zz"], min_tokens=2)
    released = [matcher.feed("zz", 1), matcher.feed("xa", 2)]  # "zz" ends in token 1: no stop
    assert matcher.matched is None
    released.append(matcher.feed("b-", 3))  # "ab" ends in token 3: the stop
    assert matcher.matched == "ab"
    assert "".join(released) == "zzx"
    # a stop wholly inside the first min_tokens tokens' text, held back while it may begin another
    matcher = StopStringMatcher(["ab", "abcd"], min_tokens=2)
    released = [matcher.feed("a", 1), matcher.feed("bc", 2), matcher.feed("e", 3), matcher.feed("ab", 4)]
    assert matcher.matched == "ab"
    assert "".join(released) == "abce"


def _by_definition(
    stop: list[str], pieces: list[str], min_tokens: int, include: bool
) -> tuple[list[str], str | None, str]:
    """What a matcher releases for each piece, the stop string found and the text flushed at
    the end, from the whole text each time: the first piece in which a stop string ends
    (after the first ``min_tokens``) ends the text where the first of those begins; until
    then, the longest end of the text that begins a stop string (shorter than the longest)
    is held back."""
    stops = list(dict.fromkeys(s for s in stop if s))
    longest = max(map(len, stops))
    text, released, out = "", 0, []
    for number, piece in enumerate(pieces, 1):
        before, text = len(text), text + piece
        hits = [
            (at, i)
            for i, s in enumerate(stops)
            for at in range(len(text) - len(s) + 1)
            if text.startswith(s, at) and at + len(s) > before and number > min_tokens
        ]
        if hits:
            at, i = min(hits)
            out.append(text[released : at + len(stops[i]) if include else at])
            return out, stops[i], ""
        keep = max(
            k
            for k in range(min(len(text) - released, longest - 1) + 1)
            if any(s.startswith(text[len(text) - k :]) for s in stops)
        )
        out.append(text[released : len(text) - keep])
        released = len(text) - keep
    return out, None, text[released:]


def test_stop_strings_are_found_and_held_back_as_defined_on_random_text() -> None:
    """Random stop strings over small alphabets (so that they overlap, repeat themselves and
    begin one another), fed random pieces: the matcher releases what the definition says."""
    rng = random.Random(0)
    for case in range(3000):
        alphabet = ["ab", "abc", "aé😀"][case % 3]
        stop = ["".join(rng.choices(alphabet, k=rng.randint(0, 7))) for _ in range(rng.randint(1, 6))]
        if not any(stop):
            continue
        pieces = ["".join(rng.choices(alphabet, k=rng.randint(0, 5))) for _ in range(rng.randint(1, 10))]
        min_tokens, include = rng.randint(0, 4), rng.random() < 0.5
        matcher = StopStringMatcher(stop, min_tokens=min_tokens, include=include)
        released = []
        for number, piece in enumerate(pieces, 1):
            released.append(matcher.feed(piece, number))
            if matcher.matched is not None:
                break
        got = (released, matcher.matched, matcher.flush())
        assert got == _by_definition(stop, pieces, min_tokens, include), (stop, pieces, min_tokens, include)


def test_a_thousand_long_stop_strings_are_matched_across_pieces() -> None:
    """64 stop strings of 1,024 characters (the server's bounds) that share long beginnings:
    the one the text completes is found across many pieces, and text that turns away from
    them all is released."""
    rng = random.Random(1)
    shared = "".join(rng.choices("xyz ", k=900))
    stop = [shared + "".join(rng.choices("xyz ", k=124)) for _ in range(64)]
    matcher = StopStringMatcher(stop)
    chosen = stop[37]
    text = "intro " + chosen + " outro"
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    released = "".join(matcher.feed(piece) for piece in pieces)
    assert matcher.matched == chosen and released == "intro "
    matcher = StopStringMatcher(stop)
    turned = "intro " + shared + "!" + " outro"
    released = "".join(matcher.feed(turned[i : i + 5]) for i in range(0, len(turned), 5))
    assert matcher.matched is None and released + matcher.flush() == turned


@pytest.mark.parametrize("stop", ["Observation:", "fox Observation:", "brown fox Observation:", "x O"])
def test_config_stop_strings_are_found_across_any_number_of_tokens(tokenizer: Any, stop: str) -> None:
    """A GenerationConfig's stop string spanning several tokens ends the text at the token
    that completes it, whatever the lengths of the text seen before; the text keeps every
    token's text (transformers' rules)."""
    text = " the quick brown fox Observation: done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    ends = [len(tokenizer.decode(ids[: n + 1])) for n in range(len(ids))]
    completing = next(n for n, end in enumerate(ends) if text.index(stop) + len(stop) <= end)
    assert text.index(stop) < ends[completing - 1], "it begins in an earlier token"
    tracker = TextTracker(tokenizer, [], config_stop=[stop])
    matched = [tracker.add(token, n) for n, token in enumerate(ids[: completing + 1], 1)]
    assert matched == [None] * completing + [stop]
    tracker.finish()
    assert tracker.text == tokenizer.decode(ids[: completing + 1])


def test_a_config_stop_string_keeps_the_text_a_request_stop_string_held(tokenizer: Any) -> None:
    """With both kinds of stop strings, a config one found while a request's is still
    possible ("fox" of "foxes") keeps every token's text, the held text included (it was
    dropped); a request's found ends the text before it."""
    ids = tokenizer.encode(" the quick brown fox jumps", add_special_tokens=False)
    for stop, text, matched in ((["foxes"], " the quick brown fox", "fox"), (["brown"], " the quick ", "brown")):
        tracker = TextTracker(tokenizer, [], stop=stop, config_stop=["fox"])
        for n, token in enumerate(ids, 1):
            if tracker.add(token, n):
                break
        tracker.finish()
        assert (tracker.text, tracker.matched) == (text, matched)


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher(["", ""])
    assert matcher.feed("anything") == "anything"
    assert matcher.held == ""


@pytest.mark.parametrize("ahead", [False, True], ids=["", "ahead"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_decode_stream_and_the_window_method_give_the_same_deltas(
    tokenizer: Any, skip_special_tokens: bool, ahead: bool
) -> None:
    rng = random.Random(1)
    specials = tokenizer.all_special_ids
    for _ in range(30):
        ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(len(tokenizer)) for _ in range(50)]
        context = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 8))]
        runs = []
        for tok in (tokenizer, DecodeOnly(tokenizer)):
            detokenizer = IncrementalDetokenizer(
                tok, context, skip_special_tokens=skip_special_tokens, release_ahead=ahead
            )
            deltas = [detokenizer.add(i) for i in ids[:25]]
            deltas.append(detokenizer.flush())  # mid-way, as after a held character
            deltas += [detokenizer.add(i) for i in ids[25:]]
            deltas.append(detokenizer.flush())
            runs.append((deltas, detokenizer.num_chars))
        assert runs[0] == runs[1]


def test_a_fast_tokenizer_decodes_through_the_stream(tokenizer: Any) -> None:
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert IncrementalDetokenizer(tokenizer, prompt)._stream is not None
    assert IncrementalDetokenizer(DecodeOnly(tokenizer), prompt)._stream is None


# ---------------------------------------------------------------------- byte-fallback tokenizers


@pytest.fixture(scope="module")
def byte_fallback() -> Any:
    return build_byte_fallback_tokenizer()


def _deltas(tokenizer: Any, prompt: list[int], ids: list[int]) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    return "".join(detokenizer.add(token) for token in ids) + detokenizer.flush()


@pytest.mark.parametrize(
    ("prompt", "completion"), [("こんにちは", "世界です"), ("Answer: 안녕", "하세요"), ("Ответ: Привет", "мир")]
)
def test_a_prompt_whose_last_tokens_start_inside_a_character_leaves_the_output_whole(
    byte_fallback: Any, prompt: str, completion: str
) -> None:
    """The context decoded with the first tokens must start on a character: a byte run
    that starts inside one decodes to U+FFFD, the new tokens' bytes with it."""
    prompt_ids = byte_fallback.encode(prompt)
    whole = byte_fallback.encode(prompt + completion)
    assert whole[: len(prompt_ids)] == prompt_ids
    generated = whole[len(prompt_ids) :]
    assert _deltas(byte_fallback, prompt_ids, generated) == byte_fallback.decode(generated) == completion


def test_a_token_that_rewrites_emitted_text_is_decoded_without_an_error(byte_fallback: Any) -> None:
    """A stray continuation byte after a complete character makes the decoder turn the whole
    run into U+FFFD, text the decode stream already emitted: it raises, and the window method
    takes over."""
    prompt = byte_fallback.encode("Hello 🐟")
    stray = byte_fallback.convert_tokens_to_ids("<0x9F>")
    generated = [stray, *byte_fallback.encode(" the end")]
    assert _deltas(byte_fallback, prompt, generated) == byte_fallback.decode(generated)


@pytest.mark.parametrize("fallback", [False, True])
def test_a_prompt_that_ends_inside_a_character_loses_no_text(
    tokenizer: Any, byte_fallback: Any, fallback: bool
) -> None:
    """A prompt of ids may end inside a character (a client resuming an output cut inside an
    emoji): the new tokens that end it decode as they do alone, and the text after them is
    whole (with the character's bytes in the context, its completion shortened the text and
    the deltas after it lost characters). With byte fallback, the character's last bytes,
    which no character can take alone, may join the context's run of bytes, which the
    decoder then gives as U+FFFD whole: their count may differ, the text after them not."""
    tok = byte_fallback if fallback else tokenizer
    ids = tok.encode("Hello 世界 and 😀 the end", add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert cuts
    for cut in cuts:
        for method in (tok, DecodeOnly(tok)):
            got, alone = _deltas(method, ids[:cut], ids[cut:]), tok.decode(ids[cut:])
            assert (got.lstrip("\ufffd"), got[0]) == (alone.lstrip("\ufffd"), alone[0]) if fallback else got == alone


def test_a_prompt_of_one_incomplete_character_loses_no_text(tokenizer: Any) -> None:
    """A prompt that is nothing but a character's first bytes: the context is left empty,
    and the new tokens decode as they do alone (as after a longer prompt ending so)."""
    ids = tokenizer.encode("Hi 😀 ok", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    alone = tokenizer.decode(ids[cut:])
    for method in (tokenizer, DecodeOnly(tokenizer)):
        assert _deltas(method, ids[cut - 1 : cut], ids[cut:]) == _deltas(method, ids[:cut], ids[cut:]) == alone


@pytest.mark.parametrize(
    ("text", "held", "expected"),
    [
        ("👍🏽", 1, "👍\ufffd"),  # (cut after the first byte of the skin tone's four)
        ("你好", 2, "你\ufffd\ufffd"),  # (after two of 好's three)
    ],
)
def test_an_output_cut_inside_a_character_ends_in_a_replacement_a_byte_held(
    byte_fallback: Any, text: str, held: int, expected: str
) -> None:
    """The decoder gives a run of bytes that is not valid UTF-8 as U+FFFD whole, the
    character already sent among it: that one is kept as sent, the held bytes each give one
    U+FFFD (the text took one for each of the run's bytes), by either method and in the
    final text."""
    cut = text[:-1].encode() + text[-1].encode()[:held]
    generated = [byte_fallback.convert_tokens_to_ids(f"<0x{b:02X}>") for b in cut]
    prompt = byte_fallback.encode("Reply:", add_special_tokens=False)
    for method in (byte_fallback, DecodeOnly(byte_fallback)):
        assert _deltas(method, prompt, generated) == expected
    tracker = TextTracker(byte_fallback, prompt)
    for count, token in enumerate(generated, 1):
        tracker.add(token, count)
    tracker.finish()
    assert tracker.text == expected


def test_a_stray_byte_after_a_character_gives_the_same_text_by_either_method(byte_fallback: Any) -> None:
    """A continuation byte after a complete character: the decode stream and the window
    method both keep the character as sent, the stray byte one U+FFFD, the words after it."""
    byte = {b: byte_fallback.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "你".encode() + b"\xa5"}
    generated = [*byte.values(), *byte_fallback.encode(" ok", add_special_tokens=False)]
    prompt = byte_fallback.encode("Reply:", add_special_tokens=False)
    assert _deltas(byte_fallback, prompt, generated) == _deltas(DecodeOnly(byte_fallback), prompt, generated)
    assert _deltas(byte_fallback, prompt, generated).startswith("你\ufffd")


def test_a_tokenizer_that_cleans_up_spaces_loses_no_text() -> None:
    """``clean_up_tokenization_spaces`` (" '" to "'", " ." to "."), which transformers applies
    to every tokenizer but BPE ones, shortens text across the context and the new tokens:
    the deltas are the text without it (as vLLM's), never missing the new tokens' characters."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "she", "said", "it", "'", "hello", "there", "."]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    prompt, generated = tok.encode("she said it '"), tok.encode("hello there .")
    assert tok.decode(prompt + generated) == "she said it'hello there."  # (cleaned up)
    for method in (tok, DecodeOnly(tok)):
        assert _deltas(method, prompt, generated) == " hello there ."


def test_a_replacement_character_in_the_prompt_leaves_the_context_on_a_character(byte_fallback: Any) -> None:
    """Whether the context starts on a character is told by its text ending a longer
    suffix's, not by its having no U+FFFD: with one of the prompt's own, the context began
    inside a character and the new bytes turned into U+FFFD with it."""
    for prompt in ("Hi ꙮéꙮ", "Hi ꙮ\ufffdꙮ"):
        ids = byte_fallback.encode(prompt + "ꙮ ok")
        cut = len(byte_fallback.encode(prompt))
        assert ids[:cut] == byte_fallback.encode(prompt)
        assert _deltas(byte_fallback, ids[:cut], ids[cut:]) == "ꙮ ok", prompt


@pytest.mark.parametrize("prompt", ["Reply: 🐟🚀🌍👍🐟🚀ꙮ", "Reply: ꙮꙮꙮꙮꙮꙮꙮꙮꙮ"])
def test_a_prompt_ending_in_a_long_run_of_byte_tokens_starts_its_context_on_a_character(
    byte_fallback: Any, prompt: str
) -> None:
    """A run of byte tokens longer than the context's longest window decodes, from inside a
    character, all to U+FFFD: the context is a suffix with no U+FFFD, not one whose text
    ends that window's (which every suffix of an all-U+FFFD text does)."""
    ids = byte_fallback.encode(prompt + "😀 ok")
    cut = len(byte_fallback.encode(prompt))
    assert ids[:cut] == byte_fallback.encode(prompt) and cut > 24
    for method in (byte_fallback, DecodeOnly(byte_fallback)):
        assert _deltas(method, ids[:cut], ids[cut:]) == "😀 ok"


@pytest.mark.parametrize("skipped", [1, 5, 8])
def test_skipped_special_tokens_between_words_keep_the_space(byte_fallback: Any, skipped: int) -> None:
    """Released without text, skipped special tokens leave the window's last text as its
    start: a window starting with them has the decoder strip the next word's space."""
    prompt = byte_fallback.encode("Question: what is it?", add_special_tokens=False)
    hello = byte_fallback.encode("Hello", add_special_tokens=False)
    there = byte_fallback.encode("Hello there world", add_special_tokens=False)[len(hello) :]
    generated = hello + [byte_fallback.convert_tokens_to_ids("<s>")] * skipped + there
    for method in (byte_fallback, DecodeOnly(byte_fallback)):
        detokenizer = IncrementalDetokenizer(method, prompt, skip_special_tokens=True)
        assert "".join(detokenizer.add(t) for t in generated) + detokenizer.flush() == " Hello there world"


@pytest.mark.parametrize(
    "generated", ["\ufffd😀 ok", "x\ufffd世界 ok", "\ufffdꙮ ok", "\ufffd" * 3 + " ok", "\ufffd" * 8]
)
def test_a_generated_replacement_character_is_text_like_any_other(byte_fallback: Any, generated: str) -> None:
    """U+FFFD written as its three byte tokens ends the text in U+FFFD, as a character
    still incomplete does: held with the next character's first bytes, a byte-fallback
    decoder gives the run one U+FFFD a byte, which was taken for bytes no character could
    take and released (the next character came out as U+FFFD, runs of them tripled)."""
    prompt = byte_fallback.encode("Answer:", add_special_tokens=False)
    ids = byte_fallback.encode(generated, add_special_tokens=False)
    assert byte_fallback.convert_ids_to_tokens(ids).count("<0xEF>") >= 1
    expected = byte_fallback.decode(prompt + ids)[len(byte_fallback.decode(prompt)) :]
    for method in (byte_fallback, DecodeOnly(byte_fallback)):
        assert _deltas(method, prompt, ids) == expected


@pytest.mark.parametrize("count", [5, 8])
def test_a_prompt_ending_in_replacement_characters_starts_its_context_on_one(byte_fallback: Any, count: int) -> None:
    """No suffix of such a prompt is free of U+FFFD: the context is one whose tokens before
    it, in the longest, decode to the rest of its text (a suffix starting inside a U+FFFD
    decodes to one U+FFFD a byte, which the longest's text ends with as well)."""
    prompt = byte_fallback.encode("Hi " + "\ufffd" * count, add_special_tokens=False)
    ids = byte_fallback.encode("Hi " + "\ufffd" * count + "ꙮ ok", add_special_tokens=False)
    assert ids[: len(prompt)] == prompt
    for method in (byte_fallback, DecodeOnly(byte_fallback)):
        assert _deltas(method, prompt, ids[len(prompt) :]) == "ꙮ ok"


def test_a_prompt_ending_in_skipped_special_tokens_keeps_the_first_words_space(byte_fallback: Any) -> None:
    prompt = byte_fallback.encode("Question: what is it?", add_special_tokens=False)
    prompt += [byte_fallback.convert_tokens_to_ids("<s>")] * 8
    for method in (byte_fallback, DecodeOnly(byte_fallback)):
        assert _deltas(method, prompt, byte_fallback.encode("Hello there", add_special_tokens=False)) == " Hello there"


class _Counting(DecodeOnly):
    """The window method, counting the ids it decodes."""

    decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("run", ["stray bytes", "skipped special tokens"])
def test_tokens_that_make_no_text_are_not_held_to_the_end(
    tokenizer: Any, byte_fallback: Any, fallback: bool, run: str
) -> None:
    """Held tokens are decoded again with each new one: a request made to generate nothing
    but stray continuation bytes (allowed_token_ids holds one) or skipped special tokens held
    them all, its cost growing with the square of its length (8,000 took 3-6 s) and its text
    coming only at the end. Now the text comes as the tokens do, and each costs the same."""
    tok = byte_fallback if fallback else tokenizer
    if run == "stray bytes":
        token = tok.convert_tokens_to_ids("<0x80>") if fallback else tok.encode("\u0100")[-1]
        assert tok.decode([token]) == "\ufffd"
    else:
        token = tok.all_special_ids[0]
    for size in (500, 2000):
        counting = _Counting(tok)
        for method in (tok, counting):
            detokenizer = IncrementalDetokenizer(method, tok.encode("Hello", add_special_tokens=False))
            streamed = "".join(detokenizer.add(token) for _ in range(size))
            assert streamed + detokenizer.flush() == tok.decode([token] * size, skip_special_tokens=True)
            assert len(streamed) >= (size - 20 if run == "stray bytes" else 0)
        assert counting.decoded < 150 * size  # (held to the end: some size * size / 2)


def test_random_ids_after_random_prompts_never_raise(byte_fallback: Any) -> None:
    rng = random.Random(4)
    vocab = len(byte_fallback)
    for _ in range(300):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(0, 12))]
        ids = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))]
        _deltas(byte_fallback, prompt, ids)


async def test_a_prepared_automaton_is_found_while_held_however_full_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop strings past ``BUILT_ON_THE_LOOP`` characters are built on a worker thread and
    held by the caller until its matchers hold them: requests that fill the cache meanwhile
    (it lets the least recently used go, one by one) do not make the matcher build them
    again on the loop. Tiny automata count for ``_ENTRY_NODES`` nodes each: a flood of them
    keeps the cache's size bounded."""
    from aiocb import stop_strings

    monkeypatch.setattr(stop_strings, "_kept", type(stop_strings._kept)())
    monkeypatch.setattr(stop_strings, "_kept_nodes", 0)
    monkeypatch.setattr(stop_strings, "_KEPT_NODES", 20_000)
    long = [f"{i:03} held while the requests are made " * 6 for i in range(8)]
    assert sum(map(len, long)) > stop_strings.BUILT_ON_THE_LOOP
    held = await stop_strings.prepare_stop_strings(long)
    assert held is not None and await stop_strings.prepare_stop_strings(long) is held
    recent = stop_strings.stop_strings(("recent",))
    for i in range(200):  # (tiny ones: each charged _ENTRY_NODES)
        stop_strings.stop_strings((f"x{i}",))
        stop_strings.stop_strings(("recent",))  # (used again and again: never the least recent)
    assert len(stop_strings._kept) <= 20_000 // stop_strings._ENTRY_NODES
    assert stop_strings._kept_nodes == sum(a.nodes + stop_strings._ENTRY_NODES for a in stop_strings._kept.values())
    assert tuple(long) not in stop_strings._kept and ("x0",) not in stop_strings._kept
    assert ("recent",) in stop_strings._kept and stop_strings.stop_strings(("recent",)) is recent
    assert StopStringMatcher(long)._automaton is held  # (found, not built again)


async def test_a_failed_build_whose_callers_all_left_is_not_left_unretrieved(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every caller cancelled (clients gone), then the build fails: its error is retrieved
    (asyncio reported "Task exception was never retrieved"), the build forgotten."""
    import asyncio
    import gc
    import threading

    from aiocb import stop_strings

    started, callers_gone = asyncio.Event(), threading.Event()
    loop = asyncio.get_running_loop()

    class Failing(stop_strings.StopStrings):
        def __init__(self, *args: Any) -> None:
            loop.call_soon_threadsafe(started.set)
            callers_gone.wait(10)
            raise MemoryError("no room for the automaton")

    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        monkeypatch.setattr(stop_strings, "StopStrings", Failing)

        async def leave_it() -> None:  # (a function of its own: nothing of the callers lingers)
            stops = [f"{i} never kept " * 20 for i in range(8)]
            callers = [asyncio.create_task(stop_strings.prepare_stop_strings(stops)) for _ in range(3)]
            await started.wait()
            for caller in callers:
                caller.cancel()
            await asyncio.gather(*callers, return_exceptions=True)

        await leave_it()
        callers_gone.set()
        for _ in range(50):  # (until the worker thread's failure has come back)
            if not stop_strings._building:
                break
            await asyncio.sleep(0.01)
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert not stop_strings._building and not reported, reported


def test_automata_looked_up_from_two_threads_at_once() -> None:
    """Managers on loops in two threads use one cache: lookups and evictions at once from
    both neither fail (iterating it while the other inserted did) nor lose its count."""
    import threading

    from aiocb import stop_strings

    errors: list[BaseException] = []

    def use(tag: str) -> None:
        try:
            for i in range(3000):
                StopStringMatcher([f"{tag}{i}:"]).feed("text")
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=use, args=(tag,)) for tag in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    with stop_strings._lock:
        assert stop_strings._kept_nodes == sum(a.nodes + stop_strings._ENTRY_NODES for a in stop_strings._kept.values())


@pytest.mark.parametrize("ahead", [False, True], ids=["", "ahead"])
@pytest.mark.parametrize("fallback", [False, True])
def test_a_token_s_start_is_where_its_own_text_starts(
    tokenizer: Any, byte_fallback: Any, fallback: bool, ahead: bool
) -> None:
    """``last_start`` after the characters that tokens held before it come out with (a
    character they made, U+FFFD for bytes no character took: a byte-fallback run that is
    not valid gives one a byte, though a byte alone may decode as a character), at the
    start of a character it shares with them: random ids' word tokens are found where it
    says."""
    rng = random.Random(1)
    chosen = byte_fallback if fallback else tokenizer
    checked = missed = 0
    for _ in range(80):
        ids = [rng.randrange(3, len(chosen)) for _ in range(30)]
        detokenizer = IncrementalDetokenizer(chosen, skip_special_tokens=False, release_ahead=ahead)
        text, starts = "", []
        for token in ids:
            text += detokenizer.add(token)
            starts.append(detokenizer.last_start)
        text += detokenizer.flush()
        assert starts == sorted(starts) and starts[-1] <= len(text)
        for token, start in zip(ids, starts, strict=True):
            raw = chosen.convert_ids_to_tokens(token)
            piece = chosen.decode([token])
            if "\ufffd" in piece or not piece.strip() or raw.startswith("<0x"):
                continue  # (a byte, or a token of no visible text)
            checked += 1
            shown = raw.replace("\u2581", " ") if fallback else piece
            if fallback and start == 0:  # (a SentencePiece decoder drops the text's first space)
                shown = shown.removeprefix(" ")
            missed += not text[start:].startswith(shown)
    assert checked > 1000 and missed == 0
