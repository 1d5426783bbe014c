"""Long prompts tokenized in the tokenizer process: the ids the server's tokenizer makes,
only the kept ones sent back, and the server's answers the same as when tokenized in
its own process."""

from __future__ import annotations

import asyncio
import io
import logging
import struct
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import aiocb
from aiocb import tokenizer_process
from aiocb.child_processes import MAX_BANNER, await_ready
from aiocb.tokenizer_process import (
    PROCESS_PROMPT_CHARS,
    Tokenized,
    TokenizerProcess,
    TokenizerProcessError,
    TokenizerProcessHolder,
    encode_kept,
)
from tests.server.conftest import CORPUS, EOS, build_byte_fallback_tokenizer, build_tokenizer


def long_text(chars: int) -> str:
    return (CORPUS + "\n") * (chars // (len(CORPUS) + 1) + 1)


@pytest.mark.parametrize("build", ["byte-level", "byte-fallback"])
def test_the_process_tokenizes_as_the_tokenizer(build: str, tokenizer: Any) -> None:
    tok = tokenizer if build == "byte-level" else build_byte_fallback_tokenizer(bos=True)
    process = TokenizerProcess.for_tokenizer(tok)
    assert process is not None
    try:
        for text in (CORPUS, f"{tok.eos_token}{CORPUS}{tok.eos_token}", "", " ", long_text(20_000)):
            for special in (True, False):
                ids = tok.encode(text, add_special_tokens=special)
                assert process.encode(text, add_special_tokens=special, keep=None, limit=None) == (ids, len(ids))
                assert process.encode(text, add_special_tokens=special, keep=5, limit=8) == (ids[-5:], len(ids))
                bounded = process.encode(text, add_special_tokens=special, keep=None, limit=8)
                assert bounded == (ids if len(ids) <= 8 else [], len(ids))
        with pytest.raises(UnicodeError):
            process.encode("text then a lone surrogate \ud800", add_special_tokens=True, keep=None, limit=None)
        assert process.encode("still answering", add_special_tokens=False, keep=None, limit=None).total > 0
    finally:
        process.close()


def test_a_child_that_died_is_started_again_and_close_ends_it(tokenizer: Any) -> None:
    process = TokenizerProcess.for_tokenizer(tokenizer)
    assert process is not None
    expected = Tokenized(tokenizer.encode(CORPUS), len(tokenizer.encode(CORPUS)))
    assert process.encode(CORPUS, add_special_tokens=True, keep=None, limit=None) == expected
    first = process._child
    assert first is not None
    first.kill()
    first.wait()
    assert process.encode(CORPUS, add_special_tokens=True, keep=None, limit=None) == expected
    second = process._child
    assert second is not None and second.pid != first.pid
    process.close()
    assert second.poll() is not None and process._child is None
    with pytest.raises(TokenizerProcessError, match="closed"):
        process.encode(CORPUS, add_special_tokens=True, keep=None, limit=None)


async def test_the_process_is_used_only_where_it_tokenizes_alike_and_off_the_loop(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not from an event loop's thread (the loop must not wait for a worker's long prompt
    there), not for a tokenizer whose copy tokenizes otherwise (``split_special_tokens``
    is not in the copy); made again once the tokenizer gained tokens, never once closed."""
    used: list[TokenizerProcess] = []  # (the objects: an id may be reused once one is freed)
    encode = TokenizerProcess.encode

    def spied(self: TokenizerProcess, text: str, **kwargs: Any) -> Tokenized:
        if len(text) > PROCESS_PROMPT_CHARS:  # (not the probes)
            used.append(self)
        return encode(self, text, **kwargs)

    monkeypatch.setattr(TokenizerProcess, "encode", spied)
    grown = build_tokenizer()
    processes = TokenizerProcessHolder(grown)
    text = long_text(PROCESS_PROMPT_CHARS + 1) + "<|im_start|>"
    try:
        expected = encode_kept(text, grown, None, add_special_tokens=True, keep=3, limit=None)
        assert encode_kept(text, grown, processes, add_special_tokens=True, keep=3, limit=None) == expected
        assert not used  # (on the loop)
        kept = await asyncio.to_thread(encode_kept, text, grown, processes, add_special_tokens=True, keep=3, limit=None)
        assert kept == expected and len(used) == 1
        grown.add_tokens(["<|new|>"])
        kept = await asyncio.to_thread(
            encode_kept, text + "<|new|>", grown, processes, add_special_tokens=True, keep=2, limit=None
        )
        assert kept.ids[-1] == grown.convert_tokens_to_ids("<|new|>") and len(set(map(id, used))) == 2  # (a new copy)
        child = processes._process._child  # type: ignore[union-attr]
        processes.close()
        assert child is not None and child.poll() is not None
        kept = await asyncio.to_thread(encode_kept, text, grown, processes, add_special_tokens=True, keep=3, limit=None)
        assert kept == expected and len(used) == 2 and processes.get() is None
    finally:
        processes.close()
    split = PreTrainedTokenizerFast(tokenizer_object=tokenizer._tokenizer, eos_token=EOS, split_special_tokens=True)
    assert TokenizerProcess.for_tokenizer(split) is None


async def test_the_server_sends_long_prompts_to_the_process(
    client: httpx.AsyncClient, manager: aiocb.Manager, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt past the threshold goes to the process, which sends back the kept tokens
    only; the answers are those of the tokens themselves; one too long for the context,
    uncut, is refused by its count."""
    calls: list[tuple[int, int | None, int | None]] = []
    encode = TokenizerProcess.encode

    def spied(self: TokenizerProcess, text: str, **kwargs: Any) -> Tokenized:
        result = encode(self, text, **kwargs)
        if len(text) > PROCESS_PROMPT_CHARS:  # (not the probes)
            calls.append((len(text), kwargs["keep"], len(result.ids)))
        return result

    monkeypatch.setattr(TokenizerProcess, "encode", spied)
    text = long_text(PROCESS_PROMPT_CHARS + 1)
    ids = tokenizer.encode(text)
    assert len(ids) > manager.model.config.max_position_embeddings

    too_long = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
    assert too_long.status_code == 400, too_long.text
    error = too_long.json()["error"]
    assert error["param"] == "prompt" and f"has {len(ids)} tokens, more than the model's context" in error["message"]
    assert calls.pop() == (len(text), None, 0)

    reference = await manager.generate(ids[-6:], max_new_tokens=3, do_sample=False, eos_token_id=[])
    body = {"prompt": text, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "echo": True}
    data = (await client.post("/v1/completions", json=body | {"truncate_prompt_tokens": 6})).json()
    assert calls.pop() == (len(text), 6, 6)
    generated = tokenizer.decode(reference.generated_tokens, skip_special_tokens=True)
    assert data["choices"][0]["text"] == tokenizer.decode(ids[-6:]) + generated
    assert data["usage"]["prompt_tokens"] == 6

    whole = await client.post("/v1/completions", json=body | {"truncate_prompt_tokens": -1})
    assert calls.pop() == (len(text), 2048, 2048)
    assert whole.status_code == 400 and "prompt (2048 tokens)" in whole.json()["error"]["message"]

    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    reference = await manager.generate(tokenizer.encode(rendered)[-5:], max_new_tokens=3, do_sample=False)
    chat = {"messages": messages, "max_tokens": 3, "temperature": 0, "truncate_prompt_tokens": 5}
    answer = (await client.post("/v1/chat/completions", json=chat)).json()
    assert calls.pop() == (len(rendered), 5, 5) and not calls
    assert answer["choices"][0]["message"]["content"] == tokenizer.decode(
        reference.generated_tokens, skip_special_tokens=True
    )
    assert answer["usage"]["prompt_tokens"] == 5


async def test_a_failed_process_leaves_the_prompt_to_the_servers_process(
    client: httpx.AsyncClient, manager: aiocb.Manager, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    encode = TokenizerProcess.encode

    def failing(self: TokenizerProcess, text: str, **kwargs: Any) -> Tokenized:
        if len(text) > PROCESS_PROMPT_CHARS:  # (the probes pass: the child fails in use)
            raise TokenizerProcessError("the tokenizer process failed: BrokenPipeError()")
        return encode(self, text, **kwargs)

    monkeypatch.setattr(TokenizerProcess, "encode", failing)
    text = long_text(PROCESS_PROMPT_CHARS + 1)
    ids = tokenizer.encode(text)
    reference = await manager.generate(ids[-4:], max_new_tokens=2, do_sample=False, eos_token_id=[])
    body = {"prompt": text, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "truncate_prompt_tokens": 4}
    with caplog.at_level(logging.WARNING, logger="aiocb.tokenizer_process"):
        data = (await client.post("/v1/completions", json=body)).json()
    assert data["choices"][0]["text"] == tokenizer.decode(reference.generated_tokens, skip_special_tokens=True)
    assert any("tokenizing in this process" in record.message for record in caplog.records)


def test_a_refusal_keeps_the_child_and_an_answer_out_of_step_is_a_failure(tokenizer: Any) -> None:
    """The tokenizer's refusal is a ValueError with its message, the child kept; what the
    interpreter printed before the child was ready is skipped; an answer out of step (a
    count beyond the bound or the total, an unknown status) is refused, not trusted."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    word_level = Tokenizer(models.WordLevel({"a": 0}, unk_token="[UNK]"))  # ([UNK] is no token)
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    process = TokenizerProcess(word_level.to_str(), ())
    try:
        assert process.encode("a a", add_special_tokens=True, keep=None, limit=None).total == 2
        child = process._child
        with pytest.raises(ValueError, match="UNK"):
            process.encode("b", add_special_tokens=True, keep=None, limit=None)
        assert process._child is child and child is not None and child.poll() is None
    finally:
        process.close()
    banner = io.BytesIO(b"a site's banner\n" + tokenizer_process._READY)
    await_ready(lambda: tokenizer_process._read(banner, 1), tokenizer_process._READY, "tokenizer process")
    babble = io.BytesIO(b"x" * (MAX_BANNER + 2))
    with pytest.raises(EOFError):
        await_ready(lambda: tokenizer_process._read(babble, 1), tokenizer_process._READY, "tokenizer process")
    answer = struct.pack("<BQQ", 0, 5, 3) + struct.pack("<3q", 1, 2, 3)
    assert tokenizer_process._answer(io.BytesIO(answer), 3) == ([1, 2, 3], 5)
    for wrong, bound in ((answer, 2), (struct.pack("<BQQ", 0, 2, 3), 0), (b"h" + answer[1:], 3)):
        with pytest.raises(ValueError, match="an answer"):
            tokenizer_process._answer(io.BytesIO(wrong), bound)


async def test_a_setting_changed_since_the_copy_makes_it_again() -> None:
    tok = build_byte_fallback_tokenizer(bos=True)
    processes = TokenizerProcessHolder(tok)
    text = long_text(PROCESS_PROMPT_CHARS + 1)
    try:
        tok.add_bos_token = False
        # (all the ids: the first would be the BOS a stale copy adds)
        kept = await asyncio.to_thread(
            encode_kept, text, tok, processes, add_special_tokens=True, keep=None, limit=None
        )
        assert kept.ids == tok.encode(text) and kept.ids[0] != tok.bos_token_id
    finally:
        processes.close()


async def test_a_tokenizer_from_a_folder_is_loaded_by_the_child_from_its_file(
    tokenizer: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is made while the holder is (a server or a manager may be built on a
    running loop); on first use the child loads the folder's ``tokenizer.json`` rather
    than a copy (``to_str`` holds the GIL, 90-150 ms for a vocabulary of 151,000), and a
    copy once the tokenizer has tokens its file lacks (its vocabulary size tells)."""
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    made: list[Any] = []
    for_tokenizer = TokenizerProcess.for_tokenizer
    monkeypatch.setattr(
        TokenizerProcess, "for_tokenizer", classmethod(lambda cls, tok: made.append(tok) or for_tokenizer(tok))
    )
    processes = TokenizerProcessHolder(loaded)
    assert not made
    text = long_text(PROCESS_PROMPT_CHARS + 1)
    try:
        ids = loaded.encode(text)
        kept = await asyncio.to_thread(
            encode_kept, text, loaded, processes, add_special_tokens=True, keep=4, limit=None
        )
        assert kept == (ids[-4:], len(ids)) and made == [loaded]
        process = processes._process
        assert process is not None and process.tokenizer_file == str(tmp_path / "tokenizer.json")
        loaded.add_tokens(["<|late|>"])
        kept = await asyncio.to_thread(
            encode_kept, text + "<|late|>", loaded, processes, add_special_tokens=False, keep=1, limit=None
        )
        assert kept.ids == [loaded.convert_tokens_to_ids("<|late|>")] and len(made) == 2
        process = processes._process
        assert process is not None and process.tokenizer_file is None
    finally:
        processes.close()
