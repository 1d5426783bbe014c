"""Text in, text out: prompts as text or chat, ``text`` / ``text_delta`` outputs, stop strings."""

from __future__ import annotations

import threading
from typing import Any
from unittest import mock

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

import aiocb
from aiocb.tokenizer_process import PROCESS_PROMPT_CHARS, Tokenized, TokenizerProcess
from tests.server.conftest import build_tokenizer, serve_model

PROMPTS = ["Привет, мир", "你好，世界", "Héllo wörld", "Emoji: 😀", "こんにちは", "The quick brown"]
NEW = 40


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> PreTrainedModel:
    return serve_model(tokenizer)


@pytest.fixture(scope="module")
def plain(model: PreTrainedModel, tokenizer: Any) -> list[list[int]]:
    """Greedy outputs of every prompt, with EOS off so that each has its NEW tokens."""
    outputs = aiocb.generate_batch(model, [tokenizer.encode(p) for p in PROMPTS], max_new_tokens=NEW, ignore_eos=True)
    return [o.generated_tokens for o in outputs.values()]


def _split_character(tokenizer: Any, tokens: list[int]) -> tuple[str, int] | None:
    """A multi-byte character of the text of ``tokens`` whose bytes come from several
    tokens, and the index of the token that completes it; None if there is none."""
    for end in range(1, len(tokens)):
        before, after = tokenizer.decode(tokens[:end]), tokenizer.decode(tokens[: end + 1])
        if not before.endswith("\ufffd") or after.endswith("\ufffd"):
            continue
        char = after[-1]
        if len(char.encode()) > 1 and tokenizer.decode(tokens[: end + 1]).count(char) == 1:
            return char, end
    return None


async def test_text_prompts_and_outputs(model: PreTrainedModel, tokenizer: Any, plain: list[list[int]]) -> None:
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate(PROMPTS[0], max_new_tokens=NEW, ignore_eos=True)
        rid = await manager.add_request(PROMPTS[1], max_new_tokens=NEW, ignore_eos=True)
        deltas = []
        async for chunk in manager.stream(rid):
            deltas.append(chunk.text_delta)
            final = chunk
    assert output.prompt_ids == tokenizer.encode(PROMPTS[0])
    assert output.generated_tokens == plain[0]
    assert output.text == tokenizer.decode(plain[0], skip_special_tokens=True)
    assert final.generated_tokens == plain[1]
    assert len(deltas) > 1 and "".join(deltas) == final.text == tokenizer.decode(plain[1], skip_special_tokens=True)


async def test_text_deltas_never_split_a_character(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]]
) -> None:
    """The streamed text only ever grows by whole characters: at every chunk it is a prefix of
    the final text, including the chunk whose last token holds the first bytes of a character
    (a stray U+FFFD there would not be)."""
    index, (_, end) = next((i, found) for i, t in enumerate(plain) if (found := _split_character(tokenizer, t)))
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        rid = await manager.add_request(PROMPTS[index], max_new_tokens=NEW, ignore_eos=True)
        seen: dict[int, str] = {}
        text = ""
        async for chunk in manager.stream(rid):
            text += chunk.text_delta or ""
            seen[len(chunk.generated_tokens)] = text
    final = tokenizer.decode(plain[index])
    assert end in seen, "no chunk ended inside the split character: the test did not exercise it"
    for count, streamed in seen.items():
        assert final.startswith(streamed), f"after {count} tokens"
    assert seen[end] == tokenizer.decode(plain[index][:end]).rstrip("\ufffd")


async def test_tokens_that_make_no_character_stream_as_they_come(model: PreTrainedModel, tokenizer: Any) -> None:
    """A request made to generate nothing but a stray continuation byte (a client's
    allowed_token_ids) streams its U+FFFD as its tokens come, not all at its end; and after a
    prompt of ids that ends inside a character, the text is what the new tokens decode to alone."""
    stray = tokenizer.encode("\u0100")[-1]
    assert tokenizer.decode([stray]) == "\ufffd"
    ids = tokenizer.encode("Emoji: 😀 then text", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        rid = await manager.add_request([1, 2, 3], max_new_tokens=64, allowed_token_ids=[stray], ignore_eos=True)
        streamed = [len(chunk.text_delta or "") async for chunk in manager.stream(rid)]
        resumed = await manager.generate(
            ids[:cut], max_new_tokens=len(ids) - cut, allowed_token_ids=ids[cut:], ignore_eos=True
        )
    assert sum(streamed[:-1]) >= 64 - 20 and sum(streamed) == 64
    assert resumed.text == tokenizer.decode(resumed.generated_tokens)  # (none lost after the character's end)


@pytest.mark.parametrize("include", [False, True])
async def test_stop_string_spanning_tokens(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]], include: bool
) -> None:
    tokens = plain[5]
    text = tokenizer.decode(tokens)
    # The text of tokens 3 and 4 with one character on each side: it spans three tokens.
    start = len(tokenizer.decode(tokens[:3])) - 1
    stop = text[start : len(tokenizer.decode(tokens[:5])) + 1]
    assert len(stop) >= 3 and text.find(stop) == start
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate(
            PROMPTS[5],
            max_new_tokens=NEW,
            ignore_eos=True,
            stop=[stop, "never matches"],
            include_stop_str_in_output=include,
        )
        stats = manager.statistics()
    assert output.finish_reason is aiocb.FinishReason.STOP and output.stop_reason == stop
    assert output.text == text[: start + (len(stop) if include else 0)]
    assert output.generated_tokens == tokens[:6]  # ended by the token that completed the match
    assert stats.free_blocks == stats.total_blocks


async def test_many_long_stop_strings_are_prepared_off_the_loop(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stop strings of more than ``BUILT_ON_THE_LOOP`` characters in all (the server allows
    64 of 1,024) have their automaton built on a worker thread, once for a request's samples
    and for a batch's prompts, and end the output where the one that appears begins."""
    from aiocb import stop_strings

    built: list[str] = []

    class Recorded(stop_strings.StopStrings):
        def __init__(self, *args: Any) -> None:
            built.append(threading.current_thread().name)
            super().__init__(*args)

    monkeypatch.setattr(stop_strings, "StopStrings", Recorded)
    tokens = plain[5]
    text = tokenizer.decode(tokens)
    start = len(tokenizer.decode(tokens[:3])) - 1
    stop = text[start : len(tokenizer.decode(tokens[:5])) + 1]
    unused = [f"{i:03} never written " * 8 for i in range(24)]
    assert sum(map(len, unused)) > stop_strings.BUILT_ON_THE_LOOP
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        samples = await manager.generate(PROMPTS[5], max_new_tokens=NEW, ignore_eos=True, stop=[*unused, stop], n=3)
        batch = await manager.generate_batch(
            [PROMPTS[5]] * 2, max_new_tokens=NEW, ignore_eos=True, stop=[stop, *unused]
        )
        # (stop strings given as an iterator: the request's own, not used up beforehand)
        once = await manager.generate(PROMPTS[5], max_new_tokens=NEW, ignore_eos=True, stop=iter([stop, *unused]))
        # (a SamplingParams' stop strings beside a keyword stop=None, which leaves them; a set)
        given = aiocb.SamplingParams(stop=[*unused[::-1], stop], max_new_tokens=NEW, ignore_eos=True)
        kept = await manager.generate(PROMPTS[5], sampling_params=given, stop=None)
        as_set = await manager.generate(PROMPTS[5], max_new_tokens=NEW, ignore_eos=True, stop={stop, *unused})
    loop = threading.current_thread().name
    # (a set is sorted: in the order of an earlier list, it finds that list's automaton)
    assert len(built) in (3, 4) and loop not in built, built
    for result in (once, kept, as_set):
        assert result.stop_reason == stop and result.generated_tokens == tokens[:6]
    for result in [*samples, *batch.values()]:
        assert result.stop_reason == stop and result.text == text[:start]
        assert result.generated_tokens == tokens[:6]


async def test_stop_string_inside_a_multibyte_character(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]]
) -> None:
    index, (char, end) = next((i, found) for i, t in enumerate(plain) if (found := _split_character(tokenizer, t)))
    text = tokenizer.decode(plain[index])
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate(PROMPTS[index], max_new_tokens=NEW, ignore_eos=True, stop=char)
    assert output.stop_reason == char
    assert output.text == text[: text.index(char)]
    assert output.generated_tokens == plain[index][: end + 1]


async def test_a_stop_string_completed_by_the_text_held_to_the_end(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]]
) -> None:
    """A request cut off by max_new_tokens inside a character ends with that character's
    bytes as U+FFFD: a stop string that text completes ends it as a stop, as the server says."""
    index, (_, end) = next((i, found) for i, t in enumerate(plain) if (found := _split_character(tokenizer, t)))
    text = tokenizer.decode(plain[index][:end])
    stop = next(text[-size:] for size in range(1, len(text)) if text.count(text[-size:]) == 1)
    assert stop.endswith("\ufffd")
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate(PROMPTS[index], max_new_tokens=end, ignore_eos=True, stop=stop)
        kept = await manager.generate(
            PROMPTS[index], max_new_tokens=end, ignore_eos=True, stop=stop, include_stop_str_in_output=True
        )
    assert (output.finish_reason, output.stop_reason) == ("stop", stop)
    assert output.text == text[: -len(stop)] and kept.text == text
    assert output.generated_tokens == plain[index][:end]


async def test_a_stop_string_before_a_tokens_incomplete_character_ends_in_that_token(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]]
) -> None:
    """A token whose text ends inside a character (byte-level BPE) gives the characters
    before it at once: a stop string among them ends the request at that token, which is
    also where ``min_tokens`` counts it."""
    index, end = next(
        (i, e)
        for i, tokens in enumerate(plain)
        for e in range(1, NEW - 1)
        if (text := tokenizer.decode(tokens[: e + 1])).endswith("\ufffd")
        and len(text.rstrip("\ufffd")) > len(tokenizer.decode(tokens[:e]).rstrip("\ufffd"))
    )
    tokens, text = plain[index], tokenizer.decode(plain[index])
    complete = tokenizer.decode(tokens[: end + 1]).rstrip("\ufffd")
    stop = next(complete[-size:] for size in range(1, len(complete)) if text.count(complete[-size:]) == 1)
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        stopped = await manager.generate(PROMPTS[index], max_new_tokens=NEW, ignore_eos=True, stop=stop)
        counted = await manager.generate(PROMPTS[index], max_new_tokens=NEW, ignore_eos=True, stop=stop, min_tokens=end)
        held = await manager.generate(
            PROMPTS[index], max_new_tokens=NEW, ignore_eos=True, stop=stop, min_tokens=end + 1
        )
    for output in (stopped, counted):
        assert output.generated_tokens == tokens[: end + 1]
        assert (output.stop_reason, output.text) == (stop, complete[: -len(stop)])
    assert held.finish_reason == "length" and held.generated_tokens == tokens and held.text == text


async def test_min_tokens_holds_back_stop_strings(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]]
) -> None:
    tokens = plain[5]
    stop = tokenizer.decode(tokens)[len(tokenizer.decode(tokens[:2])) :][:2]
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        early = await manager.generate(PROMPTS[5], max_new_tokens=NEW, ignore_eos=True, stop=stop)
        held = await manager.generate(PROMPTS[5], max_new_tokens=NEW, ignore_eos=True, stop=stop, min_tokens=10)
    assert len(early.generated_tokens) <= 4
    assert held.generated_tokens[:10] == tokens[:10] and len(held.generated_tokens) > 10


async def test_a_stop_string_that_ends_after_min_tokens_counts_where_it_begins(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]]
) -> None:
    # The last character of token k's text and the first of token k + 1's: with
    # min_tokens = k the stop string ends in token k + 1, which may end the output.
    tokens = plain[5]
    texts = [tokenizer.decode(tokens[: i + 1]) for i in range(len(tokens))]
    k = next(k for k in range(2, 10) if len(texts[k - 1]) > len(texts[k - 2]) and len(texts[k]) > len(texts[k - 1]))
    stop = texts[k][len(texts[k - 1]) - 1 : len(texts[k - 1]) + 1]
    assert stop not in texts[k - 1]  # (else it would end early)
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate(PROMPTS[5], max_new_tokens=NEW, ignore_eos=True, stop=stop, min_tokens=k)
    assert output.stop_reason == stop
    assert output.generated_tokens == tokens[: k + 1]
    assert output.text == texts[k][: texts[k].index(stop, len(texts[k - 1]) - 1)]


async def test_a_generation_configs_stop_strings_end_where_generate_ends(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]]
) -> None:
    """A GenerationConfig's ``stop_strings`` follow transformers' rules: matched in the text
    with special tokens (a chat model's ``<|im_end|>``), from the first token on
    (``min_new_tokens`` holds off only the EOS), the text of every token kept; a request's
    own ``stop`` replaces them, with its own rules (the stop string left out of ``text``)."""
    tokens, prompt = plain[5], tokenizer.encode(PROMPTS[5])
    texts = [tokenizer.decode(tokens[: i + 1]) for i in range(len(tokens))]
    k = next(k for k in range(2, 10) if len(texts[k]) > len(texts[k - 1]) + 1)
    in_text = texts[k][len(texts[k - 1]) - 1 : len(texts[k - 1]) + 1]  # (across tokens k - 1 and k)
    assert in_text not in texts[k - 1]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cases = [
        GenerationConfig(stop_strings=[in_text], min_new_tokens=k + 4),
        GenerationConfig(stop_strings=["<|im_end|>"], min_new_tokens=3, sequence_bias={(im_end,): 50.0}),
    ]
    for config in cases:
        config.update(do_sample=False, max_new_tokens=NEW, eos_token_id=tokenizer.eos_token_id)
        ids = model.generate(torch.tensor([prompt]), generation_config=config, tokenizer=tokenizer)
        expected = ids[0, len(prompt) :].tolist()
        assert len(expected) < NEW  # (it stopped)
        async with aiocb.Manager(model, config, tokenizer=tokenizer) as manager:
            output = await manager.generate(PROMPTS[5])
            own = await manager.generate(PROMPTS[5], stop=[in_text], min_tokens=0, ignore_eos=True)
        assert output.generated_tokens == expected, config.stop_strings
        assert output.finish_reason is aiocb.FinishReason.STOP and output.stop_reason == config.stop_strings[0]
        assert output.text == tokenizer.decode(expected, skip_special_tokens=True)
        if config.stop_strings == [in_text]:
            assert own.generated_tokens == tokens[: k + 1] and own.text == texts[k][: texts[k].index(in_text)]
        else:  # (<|im_end|> every token: the config's stop string replaced, nothing stops it)
            assert own.generated_tokens == [im_end] * NEW and own.text == ""


async def test_a_generation_configs_stop_string_ends_in_a_token_that_begins_a_character(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]]
) -> None:
    """A byte-level token may end a stop string and begin a character (``"n"`` and the
    first byte of ``"ñ"``): the output ends with it, as generate's, not with the later token
    that completes the character; with special tokens' text skipped or kept."""
    found = None
    for prompt, tokens in zip(PROMPTS, plain, strict=True):
        for j in range(1, len(tokens)):
            before = tokenizer.decode(tokens[:j]).rstrip("\ufffd")
            text = tokenizer.decode(tokens[: j + 1])
            ahead = text.rstrip("\ufffd")
            if text.endswith("\ufffd") and len(ahead) >= len(before) + 2 and "\ufffd" not in ahead[-2:]:
                stop = ahead[-2:]
                if stop not in tokenizer.decode(tokenizer.encode(prompt) + tokens[:j]):
                    found = prompt, tokens[: j + 1], stop
                    break
        if found:
            break
    assert found is not None
    prompt, expected, stop = found
    config = GenerationConfig(stop_strings=[stop], do_sample=False, max_new_tokens=NEW)
    ids = tokenizer.encode(prompt)
    generated = model.generate(torch.tensor([ids]), generation_config=config, tokenizer=tokenizer)
    assert generated[0, len(ids) :].tolist() == expected
    async with aiocb.Manager(model, config, tokenizer=tokenizer) as manager:
        for skip in (True, False):
            output = await manager.generate(prompt, skip_special_tokens=skip)
            assert output.generated_tokens == expected, skip
            assert output.stop_reason == stop


def test_the_prompts_end_a_stop_string_may_begin_in_is_whole_characters(tokenizer: Any) -> None:
    """A byte-level tokenizer writes a character in up to four tokens: the prompt's end is
    decoded far enough back to hold as many whole characters as a stop string may need."""
    from aiocb.detokenize import _prompt_tail

    prompt = tokenizer.encode("日本語日本語")
    assert len(prompt) > 2 * len("日本語日本語")  # (several tokens a character)
    assert _prompt_tail(tokenizer, prompt, ("日本語(",)) == "日本語"
    assert _prompt_tail(tokenizer, prompt, ("(",)) == ""


async def test_a_generation_configs_stop_string_may_begin_in_the_prompt() -> None:
    """As transformers' StopStringCriteria: a stop string that begins in the prompt ends the
    output at the token that completes it; one wholly in the prompt ends nothing."""
    from aiocb.default_model import load_default_model

    model, tokenizer = load_default_model()
    prompt = "if __name__ == "
    ids = tokenizer(prompt)["input_ids"]
    for stop, stops_at_once in (("= __", True), ("if _", False)):
        config = GenerationConfig(stop_strings=[stop], do_sample=False, max_new_tokens=6)
        expected = model.generate(torch.tensor([ids]), generation_config=config, tokenizer=tokenizer)[0, len(ids) :]
        assert (len(expected) == 1) is stops_at_once, (stop, expected)
        async with aiocb.Manager(model, config, tokenizer=tokenizer) as manager:
            output = await manager.generate(prompt)
        assert output.generated_tokens == expected.tolist(), stop
        assert (output.stop_reason == stop) is stops_at_once


async def test_chat_messages_use_the_template(model: PreTrainedModel, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Question: What is the capital of France?"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate(messages, max_new_tokens=8)
        with pytest.raises(aiocb.InvalidRequestError, match=r"messages\[0\]"):
            await manager.generate([{"content": "no role"}], max_new_tokens=8)
    assert output.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)


def test_generate_batch_with_a_tokenizer(model: PreTrainedModel, tokenizer: Any, plain: list[list[int]]) -> None:
    params = aiocb.SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    outputs = aiocb.generate_batch(model, PROMPTS[:2], tokenizer=tokenizer, sampling_params=params)
    for output, tokens in zip(outputs.values(), plain, strict=False):
        assert output.text == tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("keep", [False, True])
async def test_the_stop_token_that_ended_a_request_is_left_out_of_its_text(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]], keep: bool
) -> None:
    """As a stop string is, unless ``include_stop_str_in_output``; greedy tokens unchanged."""
    tokens = plain[5]
    at = next(i for i in range(2, NEW) if tokenizer.decode(tokens[i : i + 1]).strip() and tokens[i] not in tokens[:i])
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate(
            PROMPTS[5], max_new_tokens=NEW, stop_token_ids=[tokens[at]], include_stop_str_in_output=keep
        )
    assert output.generated_tokens == tokens[: at + 1]
    assert output.stop_reason == tokens[at]
    assert output.text == tokenizer.decode(tokens[: at + 1] if keep else tokens[:at])


async def test_a_stop_string_within_the_kept_text_of_the_stop_token_does_not_end_it_first(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]]
) -> None:
    """The stop token ended the request: its text is kept whole, and it is the stop reason,
    though a stop string ends inside that text."""
    tokens = plain[5]

    def fits(i: int) -> bool:
        piece = tokenizer.decode(tokens[i : i + 1])
        return len(piece) > 1 and tokens[i] not in tokens[:i] and piece[:-1] not in tokenizer.decode(tokens[:i])

    at = next(i for i in range(2, NEW) if fits(i))
    stop = tokenizer.decode(tokens[at : at + 1])[:-1]
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate(
            PROMPTS[5], max_new_tokens=NEW, stop_token_ids=[tokens[at]], stop=stop, include_stop_str_in_output=True
        )
    assert output.generated_tokens == tokens[: at + 1]
    assert (output.finish_reason, output.stop_reason) == ("stop", tokens[at])
    assert output.text == tokenizer.decode(tokens[: at + 1])


async def test_bad_words_are_banned_as_vllm_tokenizes_them(
    model: PreTrainedModel, tokenizer: Any, plain: list[list[int]]
) -> None:
    """vLLM's ``bad_words``: each word is banned as the tokenizer writes it alone and after
    a space (when that is another token sequence of the same length), exactly as the same
    sequences given to ``model.generate`` as ``bad_words_ids`` ban them."""
    from aiocb.prompts import bad_words_ids
    from tests.conftest import reference_generate

    prompt = tokenizer.encode(PROMPTS[5])
    greedy = reference_generate(model, prompt, NEW)
    # Words the greedy output writes as one token of their own (alone or after a space).
    texts = [tokenizer.decode([token]) for token in greedy]
    words = [text for text in texts if text.strip().isalpha()][:2]
    assert len(words) == 2, texts
    sequences = bad_words_ids(words, tokenizer)
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        assert alone in sequences
        assert (spaced in sequences) == (spaced[0] != alone[0] and len(spaced) == len(alone))
    expected = reference_generate(model, prompt, NEW, bad_words_ids=sequences)
    assert expected != greedy, "the words change nothing: the test would not notice them ignored"
    # Many words are tokenized on a worker thread before the request is built (two encodes
    # a word on the loop: 300 words held it 11 ms), and ban the same.
    many = [*words, *(f"zq{i}xv" for i in range(40))]
    expected_many = reference_generate(model, prompt, NEW, bad_words_ids=bad_words_ids(many, tokenizer))
    threads: list[str] = []

    def recorded(words: Any, tokenizer: Any) -> list[list[int]]:
        threads.append(threading.current_thread().name)
        return bad_words_ids(words, tokenizer)

    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate(PROMPTS[5], max_new_tokens=NEW, bad_words=words)
        both = await manager.generate(PROMPTS[5], max_new_tokens=NEW, bad_words=words[0], bad_words_ids=[[plain[5][5]]])
        with mock.patch("aiocb.engine.requests.bad_words_ids", recorded):
            output_many = await manager.generate(PROMPTS[5], max_new_tokens=NEW, bad_words=many)
            await manager.generate(PROMPTS[5], max_new_tokens=NEW, bad_words=words[::-1])
    assert output_many.generated_tokens == expected_many
    loop_thread = threading.current_thread().name
    assert threads[0] != loop_thread and threads[1:] == [loop_thread]  # (a few words: on the loop)
    assert output.generated_tokens == expected
    assert both.generated_tokens == reference_generate(
        model, prompt, NEW, bad_words_ids=[[plain[5][5]], *bad_words_ids(words[:1], tokenizer)]
    )


async def test_long_text_and_chat_prompts_are_tokenized_in_the_process(
    model: PreTrainedModel, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt past the tokenizer process's threshold is tokenized there, only its kept
    tokens sent back (every way of adding it); uncut and longer than the context, it is
    refused by its count."""
    sent: list[tuple[int, int | None]] = []
    encode = TokenizerProcess.encode

    def spied(self: TokenizerProcess, text: str, **kwargs: Any) -> Tokenized:
        result = encode(self, text, **kwargs)
        if len(text) > PROCESS_PROMPT_CHARS:  # (not the probes)
            sent.append((kwargs["keep"], len(result.ids)))
        return result

    monkeypatch.setattr(TokenizerProcess, "encode", spied)
    text = " ".join(PROMPTS) * (PROCESS_PROMPT_CHARS // len(" ".join(PROMPTS)) + 1)
    ids = tokenizer.encode(text)
    assert len(ids) > model.config.max_position_embeddings
    messages = [{"role": "user", "content": text}]
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        expected = await manager.generate(ids[-8:], max_new_tokens=4, ignore_eos=True)
        cut = await manager.generate(text, max_new_tokens=4, ignore_eos=True, truncate_prompt_tokens=8)
        assert sent.pop() == (8, 8)
        assert cut.prompt_ids == ids[-8:] and cut.generated_tokens == expected.generated_tokens
        batched = await manager.generate_batch([text], max_new_tokens=4, ignore_eos=True, truncate_prompt_tokens=8)
        assert sent.pop() == (8, 8) and next(iter(batched.values())).generated_tokens == expected.generated_tokens
        chat = await manager.generate(messages, max_new_tokens=4, ignore_eos=True, truncate_prompt_tokens=5)
        assert sent.pop() == (5, 5) and chat.prompt_ids == chat_ids[-5:]
        with pytest.raises(aiocb.InvalidRequestError, match=rf"the prompt has {len(ids)} tokens, more than"):
            await manager.generate(text, max_new_tokens=4)
        assert sent.pop() == (None, 0) and not sent
        child = manager._requests._processes._process._child  # type: ignore[union-attr]
        assert child is not None and child.poll() is None
        await manager.destroy()
    assert child.poll() is not None  # (the manager's end ends the child)


def test_a_chat_is_large_by_all_its_text_not_its_contents_alone() -> None:
    """Tokenized off the loop when large: a turn's tool call arguments and many short turns
    count (rendered and tokenized on the loop, they held it 15-30 ms)."""
    from aiocb.prompts import is_large

    call = {"type": "function", "function": {"name": "run", "arguments": "x = 1\n" * 4000}}
    assert is_large([{"role": "user", "content": "run it"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    assert is_large([{"role": "user", "content": "ok"}] * 1500)
    assert is_large([{"role": "user", "content": [{"type": "text", "text": "y" * 5000}]}])
    assert not is_large([{"role": "user", "content": "hello"}] * 10)
