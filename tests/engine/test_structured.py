"""Constrained decoding: JSON schemas, regular expressions, choices and grammars, through
the manager with the bundled model and its tokenizer, at temperature 1.0."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

import aiocb  # noqa: E402
from aiocb.default_model import load_default_model  # noqa: E402
from aiocb.structured import answer_format  # noqa: E402

NEW = 120

SCHEMAS: list[dict[str, Any]] = [
    {  # nested objects, required fields
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "name": {"type": "string", "maxLength": 10},
                },
                "required": ["id", "name"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    {  # an array of enums
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4}},
        "required": ["tags"],
    },
    {  # numbers with bounds
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
        },
        "required": ["age", "score"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1, "maxItems": 5},
    {  # an enum and an optional field
        "type": "object",
        "properties": {"kind": {"enum": ["a", "b"]}, "note": {"type": "string", "maxLength": 8}},
        "required": ["kind"],
        "additionalProperties": False,
    },
]
PROMPTS = ["def parse(data):", "import json\n", "class Config:", "# settings\n", "x = {", "return "]


@pytest.fixture(scope="module")
def bundled() -> tuple[Any, Any]:
    return load_default_model()


async def _run(model: Any, tokenizer: Any, specs: list[dict[str, Any]], **config: Any) -> list[aiocb.GenerationOutput]:
    cb_config = aiocb.ContinuousBatchingConfig(**config) if config else None
    async with aiocb.Manager(model, tokenizer=tokenizer, continuous_batching_config=cb_config) as manager:
        ids = [await manager.add_request(spec.pop("prompt"), max_new_tokens=NEW, **spec) for spec in specs]
        outputs = [await manager.get_result(i) for i in ids]
        stats = manager.statistics()
    assert stats.free_blocks == stats.total_blocks, "blocks leaked"
    assert all(o is not None for o in outputs)
    return outputs  # type: ignore[return-value]


def _specs(constrained: bool, free: bool, count: int = 20) -> list[dict[str, Any]]:
    specs = []
    for i in range(count):
        spec: dict[str, Any] = {"prompt": PROMPTS[i % len(PROMPTS)], "temperature": 1.0, "seed": 1000 + i}
        if i % 2 == 0 and constrained:
            specs.append({**spec, "json_schema": SCHEMAS[(i // 2) % len(SCHEMAS)]})
        elif i % 2 == 1 and free:
            specs.append(spec)
    return specs


async def test_json_schema_outputs_validate_and_free_rows_do_not_notice(bundled: tuple[Any, Any]) -> None:
    model, tokenizer = bundled
    mixed = await _run(model, tokenizer, _specs(constrained=True, free=True))
    free_alone = await _run(model, tokenizer, _specs(constrained=False, free=True))
    constrained, free = mixed[0::2], mixed[1::2]
    for i, output in enumerate(constrained):
        schema = SCHEMAS[i % len(SCHEMAS)]
        assert output.finish_reason is aiocb.FinishReason.STOP, output.text
        jsonschema.validate(json.loads(output.text or ""), schema)
    assert [o.generated_tokens for o in free] == [o.generated_tokens for o in free_alone]
    assert len({o.text for o in constrained}) > len(SCHEMAS) // 2, "samples should differ"


async def test_async_batching_gives_the_same_constrained_outputs(bundled: tuple[Any, Any]) -> None:
    # The next mask depends on the last token: a constrained row is never planned ahead.
    model, tokenizer = bundled
    plain = await _run(model, tokenizer, _specs(constrained=True, free=True, count=10))
    pipelined = await _run(model, tokenizer, _specs(constrained=True, free=True, count=10), use_async_batching=True)
    assert [o.generated_tokens for o in pipelined] == [o.generated_tokens for o in plain]


async def test_regex_choice_and_grammar_outputs_match(bundled: tuple[Any, Any]) -> None:
    model, tokenizer = bundled
    grammar = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
    choices = ["alpha", "beta", "gamma delta"]
    specs: list[dict[str, Any]] = []
    for i in range(6):
        base = {"prompt": PROMPTS[i], "temperature": 1.0, "seed": i}
        specs += [
            {**base, "regex": r"[a-f]{3}-[0-9]{2,4}"},
            {**base, "choice": choices},
            {**base, "grammar": grammar},
        ]
    outputs = await _run(model, tokenizer, specs)
    for regex_out, choice_out, grammar_out in zip(outputs[0::3], outputs[1::3], outputs[2::3], strict=True):
        assert re.fullmatch(r"[a-f]{3}-[0-9]{2,4}", regex_out.text or ""), regex_out.text
        assert choice_out.text in choices
        assert re.fullmatch(r"\(([1-9][0-9]?)(,[1-9][0-9]?)*\)", grammar_out.text or ""), grammar_out.text
        for output in (regex_out, choice_out, grammar_out):
            assert output.finish_reason is aiocb.FinishReason.STOP


async def test_structural_tags_in_both_forms(bundled: tuple[Any, Any]) -> None:
    """A tag in xgrammar's form (fixed text around a schema), and the older form of
    ``structures`` and ``triggers`` that vLLM clients send: free text whose tagged spans
    follow the schema."""
    model, tokenizer = bundled
    schema = SCHEMAS[2]
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "answer = ",
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
            "end": "\n",
        },
    }
    older = {"type": "structural_tag", "structures": [{"begin": "(", "schema": schema, "end": ")"}], "triggers": ["("]}
    specs: list[dict[str, Any]] = []
    for i in range(6):
        base = {"prompt": PROMPTS[i], "temperature": 1.0, "seed": 50 + i}
        specs += [{**base, "structural_tag": tag}, {**base, "structural_tag": json.dumps(older)}]
    outputs = await _run(model, tokenizer, specs)
    tagged = 0
    for whole, free in zip(outputs[0::2], outputs[1::2], strict=True):
        assert whole.finish_reason is aiocb.FinishReason.STOP, whole.text
        match = re.fullmatch(r"answer = (.*)\n", whole.text or "", re.DOTALL)
        assert match is not None, whole.text
        jsonschema.validate(json.loads(match.group(1)), schema)
        for span in re.findall(r"\((.*?)\)", free.text or ""):  # every "(" opens a tagged span
            jsonschema.validate(json.loads(span), schema)
            tagged += 1
    assert tagged > 0, "code opens parentheses: some spans should be there to check"


async def test_length_bounded_strings_hold_no_raw_control_character(bundled: tuple[Any, Any]) -> None:
    """xgrammar's rule for a string with ``maxLength`` or ``minLength`` takes raw control
    characters, which JSON forbids: the grammar is mended, in every constraint that holds
    a schema (a json_schema, a structural tag's, and the tool calls' and answers' that the
    server builds of them), so outputs still parse (here with the control characters'
    tokens favoured)."""
    model, tokenizer = bundled
    controls = [i for i in range(len(tokenizer)) if any(ord(c) < 32 for c in tokenizer.decode([i]))]
    assert len(controls) > 8
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 6}, "b": {"type": "string", "minLength": 2}},
        "required": ["a", "b"],
    }
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "x = ",
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
            "end": ";",
        },
    }
    favoured = {"logit_bias": dict.fromkeys(controls, 8.0), "temperature": 1.0}
    specs: list[dict[str, Any]] = []
    for i in range(4):
        base = {"prompt": PROMPTS[i], "seed": 7 + i, **favoured}
        specs += [{**base, "json_schema": schema}, {**base, "structural_tag": tag}]
    outputs = await _run(model, tokenizer, specs)
    for whole, tagged in zip(outputs[0::2], outputs[1::2], strict=True):
        assert whole.finish_reason is aiocb.FinishReason.STOP, whole.text
        jsonschema.validate(json.loads(whole.text or ""), schema)
        match = re.fullmatch(r"x = (.*);", tagged.text or "", re.DOTALL)
        assert match is not None, tagged.text
        jsonschema.validate(json.loads(match.group(1)), schema)
    # (a harmony answer's format is the schema's grammar)
    answer = answer_format(("json_schema", json.dumps(schema)))
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_grammar(answer["grammar"]))
    assert matcher.accept_string('{"a": "ok", ') and not matcher.accept_string('"b": "\x01')
    # (nor a tool call's arguments, in the tag xgrammar writes for a model's tool calls:
    # its json_schema formats say ``"excludes": []``)
    from aiocb.server.tools import parse_tools, structural_tag
    from aiocb.structured import _mended_json_elements

    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    request = parse_tools({"tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    assert request is not None
    calls = _mended_json_elements(json.dumps(structural_tag(request, "qwen_3", "disabled", "\n")))
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_structural_tag(calls))
    assert matcher.accept_string('<tool_call>\n{"name": "f", "arguments": {"a": "ok", ')
    assert not matcher.accept_string('"b": "\x1b')


async def test_a_complete_grammar_ends_with_the_requests_own_end_tokens(bundled: tuple[Any, Any]) -> None:
    """The bundled model's config ends on token 0, its GenerationConfig on 0 or 2: a grammar
    ends on either unless the request names its own (greedy: equal to ``model.generate``
    with xgrammar's processor and the same end tokens)."""
    import torch
    import xgrammar as xgr
    from transformers import GenerationConfig, LogitsProcessorList

    model, tokenizer = bundled
    assert model.config.eos_token_id == 0 and sorted(model.generation_config.eos_token_id) == [0, 2]
    prompt, regex = "return ", r"[a-z]{2,6}\(\d\)"
    ids = tokenizer.encode(prompt)

    def reference(ends: list[int]) -> list[int]:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=ends)
        processor = xgr.contrib.hf.LogitsProcessor(xgr.GrammarCompiler(info).compile_regex(regex))
        config = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=ends, pad_token_id=0)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), generation_config=config, logits_processor=LogitsProcessorList([processor])
            )
        return list(out[0, len(ids) :].tolist())

    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        for ends in ([0, 2], [0], [2]):
            given = {} if ends == [0, 2] else {"eos_token_id": ends}
            output = await manager.generate(prompt, max_new_tokens=30, temperature=0, regex=regex, **given)
            expected = reference(ends)
            assert output.generated_tokens == expected, ends
            assert expected[-1] in ends and output.stop_reason == expected[-1]
            assert re.fullmatch(regex, output.text or ""), output.text
    assert reference([0, 2])[-1] == 2 and reference([0])[-1] == 0  # (the end token chosen differs)
    # A stop token of its own beside the EOS ends a complete grammar too (favoured by a bias here).
    newline = tokenizer.encode("\n")[-1]
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate(
            prompt, max_new_tokens=30, temperature=0, regex=regex, stop_token_ids=[newline], logit_bias={newline: 50.0}
        )
    assert output.stop_reason == newline and output.generated_tokens[-1] == newline
    assert re.fullmatch(regex, tokenizer.decode(output.generated_tokens[:-1])), output.text


async def test_a_request_without_end_tokens_goes_on_while_its_grammar_allows(bundled: tuple[Any, Any]) -> None:
    """With ``ignore_eos`` a complete grammar that allows more is not ended by the model's
    EOS (favoured here by a bias); one that allows nothing more still ends."""
    model, tokenizer = bundled
    favoured = {"logit_bias": {0: 50.0, 2: 50.0}, "temperature": 0}
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        open_ended = await manager.generate("x = '", regex="[a-z]+", ignore_eos=True, max_new_tokens=8, **favoured)
        ending = await manager.generate("return ", regex=r"[a-z]{2,6}\(\d\)", ignore_eos=True, max_new_tokens=30)
        ended = await manager.generate("x = '", regex="[a-z]+", max_new_tokens=8, **favoured)
    assert open_ended.finish_reason is aiocb.FinishReason.LENGTH and len(open_ended.generated_tokens) == 8
    assert re.fullmatch("[a-z]+", open_ended.text or ""), open_ended.text
    assert ending.finish_reason is aiocb.FinishReason.STOP and ending.generated_tokens[-1] in (0, 2)
    assert re.fullmatch(r"[a-z]{2,6}\(\d\)", tokenizer.decode(ending.generated_tokens[:-1])), ending.text
    assert ended.finish_reason is aiocb.FinishReason.STOP and len(ended.generated_tokens) < 8  # (the bias's effect)


async def test_a_pydantic_model_and_several_samples(bundled: tuple[Any, Any]) -> None:
    model, tokenizer = bundled

    class Point(pydantic.BaseModel):  # type: ignore[misc,name-defined]
        x: int = pydantic.Field(ge=-50, le=50)
        y: int = pydantic.Field(ge=-50, le=50)
        label: str = pydantic.Field(max_length=6)

    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        samples = await manager.generate("p = ", max_new_tokens=NEW, json_schema=Point, temperature=1.0, seed=7, n=3)
    assert isinstance(samples, list) and len(samples) == 3
    assert all(s.finish_reason is aiocb.FinishReason.STOP for s in samples)
    points = [Point.model_validate_json(s.text or "") for s in samples]
    assert len({p.model_dump_json() for p in points}) > 1, "each sample follows its own stream"


async def test_bad_constraints_are_refused_by_name(bundled: tuple[Any, Any]) -> None:
    model, tokenizer = bundled
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"json_schema": {"type": "nonsense"}}, "json_schema cannot be compiled"),
            ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
            ({"json_schema": int}, "not a pydantic model class"),
            ({"regex": "("}, "regex cannot be compiled"),
            ({"grammar": "root ::= "}, "grammar cannot be compiled"),
            ({"choice": []}, "choice must be a non-empty list"),
            ({"choice": "yes"}, "choice must be a non-empty list"),
            ({"regex": "a", "choice": ["a"]}, "at most one of"),
            ({"structural_tag": {"type": "structural_tag"}}, "structural_tag cannot be compiled"),
            ({"structural_tag": ["a"]}, "structural_tag must be a JSON object"),
        ]
        for params, message in cases:
            with pytest.raises(aiocb.InvalidRequestError, match=message) as caught:
                await manager.generate("x = ", max_new_tokens=4, **params)
            # (xgrammar's words, without the time and C++ source position it writes before them)
            assert not re.search(r"\[[0-9:]+\]|\.cc:|\n", str(caught.value)), str(caught.value)
        # the manager goes on serving
        output = await manager.generate("x = ", max_new_tokens=4, choice=["ok"])
        assert output.text == "ok"
        stats = manager.statistics()
    assert stats.free_blocks == stats.total_blocks
    async with aiocb.Manager(model) as manager:  # no tokenizer
        with pytest.raises(aiocb.InvalidRequestError, match="regex needs a tokenizer"):
            await manager.generate(tokenizer.encode("x = "), max_new_tokens=4, regex="[0-9]+")


@pytest.mark.slow
async def test_a_thousand_requests_half_constrained_by_five_schemas(bundled: tuple[Any, Any]) -> None:
    model, tokenizer = bundled
    config = {"max_requests_per_batch": 256, "num_blocks": 512, "page_size": 64}
    mixed = await _run(model, tokenizer, _specs(constrained=True, free=True, count=1000), **config)
    free_alone = await _run(model, tokenizer, _specs(constrained=False, free=True, count=1000), **config)
    for i, output in enumerate(mixed[0::2]):
        jsonschema.validate(json.loads(output.text or ""), SCHEMAS[i % len(SCHEMAS)])
    assert [o.generated_tokens for o in mixed[1::2]] == [o.generated_tokens for o in free_alone]


async def test_a_stop_string_ends_a_constrained_request_first(bundled: tuple[Any, Any]) -> None:
    model, tokenizer = bundled
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        outputs = [
            await manager.generate("x = ", max_new_tokens=20, regex=r"(ab)+;", stop="b", temperature=1.0, seed=s)
            for s in range(3)
        ]
    for output in outputs:
        assert output.text == "a" and output.stop_reason == "b"
        assert output.finish_reason is aiocb.FinishReason.STOP


def _eos_last_tokenizer() -> Any:
    """A tokenizer whose EOS is its last token, not token 0 (as in Qwen's and Llama's, where
    token 0 is "!"): a row with every logit masked draws token 0, which must not pass."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.server.conftest import CORPUS

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=640, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator([CORPUS] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    return tokenizer


async def test_min_tokens_gives_way_to_a_complete_grammar_and_a_conflict_fails_the_request() -> None:
    """A complete grammar can only stop: min_tokens must not ban that (it left no token,
    and the masked row's token 0 came out as "valid"). Controls that leave the grammar no
    token at all fail the request, naming the conflict, and harm no other."""
    from tests.conftest import tiny_qwen3

    tokenizer = _eos_last_tokenizer()
    assert tokenizer.eos_token_id != 0 and tokenizer.convert_ids_to_tokens(0) == "!"
    model = tiny_qwen3(0, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        for params in ({"min_tokens": 6}, {"min_tokens": 6, "temperature": 1.0, "seed": 3}):
            output = await manager.generate("Answer:", choice=["yes", "no"], max_new_tokens=10, **params)
            assert output.text in ("yes", "no") and output.finish_reason is aiocb.FinishReason.STOP
        output = await manager.generate("x", json_schema=schema, max_new_tokens=40, min_tokens=30)
        assert isinstance(json.loads(output.text)["a"], bool)
        letter = tokenizer.convert_tokens_to_ids("a")
        failed, mate = await asyncio.gather(
            manager.generate("x", regex=r"\d+", allowed_token_ids=[letter], max_new_tokens=8),
            manager.generate("x", regex=r"\d+", max_new_tokens=8),
        )
        stats = manager.statistics()
    assert failed.status is aiocb.RequestStatus.FAILED and failed.finish_reason is aiocb.FinishReason.ERROR
    assert failed.error is not None and "output constraint" in failed.error
    assert re.fullmatch(r"\d+", mate.text or "")
    assert stats.free_blocks == stats.total_blocks


async def test_a_long_constraint_compiles_in_a_lane_of_its_own(
    bundled: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A constraint that takes minutes to compile (an enum of thousands) never holds up a
    short one, nor the loop's default executor."""
    import threading

    from aiocb.structured import GrammarCompiler

    release = threading.Event()
    compile_ = GrammarCompiler.compile

    def slow_when_long(self: GrammarCompiler, structure: tuple[str, str]) -> Any:
        if len(structure[1]) > 16_384:
            release.wait(30)
        return compile_(self, structure)

    monkeypatch.setattr(GrammarCompiler, "compile", slow_when_long)
    model, tokenizer = bundled
    # More of them than the default executor has threads.
    longs = ["(" + "|".join(f"w{i}x{j}" for i in range(3000)) + ")" for j in range(40)]
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        slow = [asyncio.create_task(manager.generate("x", regex=r, max_new_tokens=2)) for r in longs]
        await asyncio.sleep(0.05)
        short = await asyncio.wait_for(manager.generate("x", regex="[ab]{3}", max_new_tokens=8), 20)
        assert re.fullmatch("[ab]{3}", short.text or "") and not any(task.done() for task in slow)
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 5) == "free"  # (the default executor)
        release.set()
        assert all(output.text for output in await asyncio.wait_for(asyncio.gather(*slow), 120))


@pytest.mark.parametrize(
    ("keyword", "schema"),
    [
        ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
        # (deeper, where it is tried in the schema that holds it, whose reference names the root's)
        (
            "uniqueItems",
            {
                "$defs": {"Tag": {"type": "string", "maxLength": 4}},
                "type": "object",
                "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}, "uniqueItems": True}},
            },
        ),
        (
            "not",
            {"type": "object", "properties": {"a": {"type": "integer"}}, "not": {"required": ["a"]}},
        ),
        # (xgrammar writes this one's root rule otherwise than without it, but ignores it all the same)
        ("not", {"type": "string", "not": {"const": "a"}}),
        ("contains", {"type": "array", "contains": {"const": 1}}),  # (its grammar takes [] alone)
        # Forms of keywords it is known to leave out, whose grammar is written otherwise too:
        ("multipleOf", {"type": "array", "items": {"type": "number", "multipleOf": 0.5}}),
        # (beside a $ref, which xgrammar follows alone: every constraint there is left out)
        (
            "properties",
            {
                "$defs": {"D": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
                "$ref": "#/$defs/D",
                "properties": {"a": {"type": "integer", "multipleOf": 3}},
            },
        ),
        ("multipleOf", {"type": "integer", "multipleOf": 2.5}),
        (
            "minimum",
            {"$defs": {"A": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/A", "minimum": 0}}},
        ),
        # (a reference xgrammar cannot follow: it warns, and takes any value there)
        ("$ref", {"$ref": "#a", "$defs": {"A": {"$anchor": "a", "type": "integer"}}}),
        ("$ref", {"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}),
        ("$ref", {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}),
        ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 5, "maximum": 9}]}),
        ("oneOf", {"oneOf": [{"type": "integer", "maximum": 50}, {"type": "integer", "minimum": 10}]}),
        ("required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]}),
        ("maxLength", {"type": "string", "pattern": "[a-z]+", "maxLength": 3}),
        # (no value is of no type: xgrammar's grammar took some all the same)
        ("type", {"type": "object", "properties": {"a": {"type": []}}}),
    ],
)
async def test_a_schema_keyword_the_grammar_cannot_enforce_is_refused_by_name(
    bundled: tuple[Any, Any], keyword: str, schema: dict[str, Any]
) -> None:
    """Left out of the grammar, it would let through outputs the schema forbids. A property
    that happens to be called so is no keyword."""
    model, tokenizer = bundled
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        with pytest.raises(aiocb.InvalidRequestError, match=re.escape(f"'{keyword}' at /")) as caught:
            await manager.generate("x", json_schema=schema, max_new_tokens=4)
        assert caught.value.param == "json_schema"
        small = {"type": "integer", "minimum": 0, "maximum": 99}
        named = {"type": "object", "properties": {keyword: small}, "required": [keyword], "additionalProperties": False}
        output = await manager.generate("x", json_schema=named, max_new_tokens=40)
        assert isinstance(json.loads(output.text or "")[keyword], int)


async def test_a_grammar_complete_under_min_tokens_ends_with_its_end_token_as_the_stop_reason(
    bundled: tuple[Any, Any],
) -> None:
    model, tokenizer = bundled
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        params = {"choice": ["yes", "no"], "max_new_tokens": 8, "temperature": 0, "skip_special_tokens": False}
        plain = await manager.generate("x", **params)
        held = await manager.generate("x", **params, min_tokens=8)
    assert held.generated_tokens == plain.generated_tokens
    assert held.stop_reason == plain.stop_reason == plain.generated_tokens[-1]
    # Its text is left out as any stop token's (special tokens kept, so it would show).
    assert held.text == plain.text in ("yes", "no")


async def test_unions_whose_schemas_cannot_overlap_are_served(bundled: tuple[Any, Any]) -> None:
    """A ``oneOf`` is enforced as any of its schemas: exactly one, where no two can match
    the same value (a pydantic discriminated union, schemas of different types), and so is
    an ``allOf`` of one schema."""
    from typing import Annotated, Literal

    import pydantic

    class Cat(pydantic.BaseModel):
        kind: Literal["cat"]
        lives: int = pydantic.Field(ge=0, le=9)

    class Dog(pydantic.BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pet(pydantic.BaseModel):
        pet: Annotated[Cat | Dog, pydantic.Field(discriminator="kind")]

    class Bird(pydantic.BaseModel):
        kind: Literal["bird"] = "bird"  # (a tag with a default: not required)
        wings: int = pydantic.Field(ge=0, le=4)

    class Fish(pydantic.BaseModel):
        kind: Literal["fish"] = "fish"
        fins: int = pydantic.Field(ge=0, le=9)

    class Tagged(pydantic.BaseModel):
        pet: Annotated[Bird | Fish, pydantic.Field(discriminator="kind")]

    model, tokenizer = bundled
    typed = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3}]}
    units = {"oneOf": [{"const": "celsius", "description": "C"}, {"const": "fahrenheit"}, {"enum": ["kelvin", 0]}]}
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        for schema in (Pet.model_json_schema(), Tagged.model_json_schema(), typed, units, {"allOf": [typed]}):
            outputs = await manager.generate_batch(["x"] * 4, json_schema=schema, max_new_tokens=NEW, seed=3)
            for output in outputs.values():
                if output.finish_reason is aiocb.FinishReason.STOP:
                    jsonschema.validate(json.loads(output.text or ""), schema)


async def test_a_keyword_enforced_in_the_whole_is_served_where_its_schema_cannot_be_built_alone(
    bundled: tuple[Any, Any],
) -> None:
    """Its schema's reference reaches outside it (``#/properties/a``): tried in the whole."""
    model, tokenizer = bundled
    referenced = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {
                "type": "object",
                "properties": {"m": {"$ref": "#/properties/a"}},
                "required": ["m"],
                "unevaluatedProperties": True,  # (what xgrammar's strict mode would leave out)
            },
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate("x", json_schema=referenced, max_new_tokens=NEW, temperature=0)
    if output.finish_reason is aiocb.FinishReason.STOP:
        jsonschema.validate(json.loads(output.text or ""), referenced)


async def test_wide_schemas_are_checked_without_work_growing_as_their_square(
    bundled: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hundreds of checked keywords, or a ``oneOf`` of a thousand values, under the short
    constraints' size: each checked keyword was once tried by building the whole schema's
    grammar anew, and a ``oneOf``'s schemas were compared two by two (seconds, holding up
    every short constraint). A ``oneOf`` too wide to compare is refused, not compared."""
    import xgrammar

    from aiocb import structured

    builds: list[str] = []
    build = xgrammar.Grammar.from_json_schema

    def counted(schema: str, **kwargs: Any) -> Any:
        builds.append(schema)
        return build(schema, **kwargs)

    monkeypatch.setattr(xgrammar.Grammar, "from_json_schema", staticmethod(counted))
    pairs: list[int] = []
    apart = structured._apart
    monkeypatch.setattr(structured, "_apart", lambda *args: pairs.append(1) or apart(*args))
    model, tokenizer = bundled
    stepped = {f"p{i}": {"type": "integer", "multipleOf": 3} for i in range(300)}
    wide = {"type": "object", "properties": stepped}
    units = {"oneOf": [{"const": i} for i in range(1000)]}
    closed = [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(structured.MOST_ONE_OF_PAIRS_COMPARED + 1)
    ]
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        assert len(json.dumps(wide)) < 16_384 and len(json.dumps(units)) < 16_384  # (short ones)
        await manager.generate("x", json_schema=wide, max_new_tokens=2)
        # the whole (checked, then compiled), and the property schema with and without the keyword
        assert len(builds) <= 4
        output = await manager.generate("x", json_schema=units, max_new_tokens=NEW, temperature=0)
        if output.finish_reason is aiocb.FinishReason.STOP:
            jsonschema.validate(json.loads(output.text or ""), units)
        assert not pairs  # (their values are all apart: no two compared)
        await manager.generate("x", json_schema={"oneOf": closed[:-1]}, max_new_tokens=2)
        assert len(pairs) == len(closed[:-1]) * (len(closed) - 2) // 2
        with pytest.raises(aiocb.InvalidRequestError, match="'oneOf' at /"):
            await manager.generate("x", json_schema={"oneOf": closed}, max_new_tokens=2)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"const": {"not": 1}}}, "required": ["a"]},
        {"enum": [{"not": "x"}, 1]},
        {
            "type": "object",
            "properties": {
                "properties": {
                    "type": "object",
                    "properties": {"not": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["not"],
                    "additionalProperties": False,
                }
            },
            "required": ["properties"],
            "additionalProperties": False,
        },
    ],
)
async def test_a_keyword_name_inside_data_or_a_map_of_names_is_no_keyword(
    bundled: tuple[Any, Any], schema: dict[str, Any]
) -> None:
    """``not`` as a constant's key, an enum member's or a property's name is served."""
    model, tokenizer = bundled
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate("x", json_schema=schema, max_new_tokens=NEW, temperature=0)
    assert output.finish_reason is aiocb.FinishReason.STOP, output.text
    jsonschema.validate(json.loads(output.text or ""), schema)


async def test_a_structural_tag_whose_schema_holds_such_a_keyword_is_refused_naming_the_tag(
    bundled: tuple[Any, Any],
) -> None:
    """In either form of the tag; a tag whose schemas the grammar enforces whole is served."""
    model, tokenizer = bundled
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    content = {"type": "json_schema", "json_schema": unique}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "xs = ", "content": content, "end": "\n"}}
    older = {"type": "structural_tag", "structures": [{"begin": "(", "schema": unique, "end": ")"}], "triggers": ["("]}
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        for given, begin in ((tag, "xs = "), (older, "(")):
            with pytest.raises(aiocb.InvalidRequestError) as caught:
                await manager.generate("x", structural_tag=given, max_new_tokens=4)
            assert caught.value.param == "structural_tag"
            assert f"tag beginning {begin!r}: 'uniqueItems' at /" in str(caught.value)
        del unique["uniqueItems"]
        output = await manager.generate("x", structural_tag=tag, max_new_tokens=40)
        assert output.finish_reason is not aiocb.FinishReason.ERROR


@pytest.mark.parametrize(
    ("tag_format", "path"),
    [
        ({"type": "const_string", "value": "x", "valeu": "y"}, "format.valeu"),
        (
            {"type": "tag", "begin": "<a>", "content": {"type": "any_text", "max_token": 9}, "end": "</a>"},
            "format.content.max_token",
        ),
        (
            {
                "type": "triggered_tags",
                "triggers": ["<a"],
                "tags": [{"begin": "<a>", "content": {"type": "any_text"}, "end": "</a>", "stop": 1}],
            },
            "format.tags[0].stop",
        ),
        (
            {"type": "sequence", "elements": [{"type": "const_string", "value": "x"}], "stop_after_frist": True},
            "format.stop_after_frist",
        ),
        (
            {"type": "dispatch", "rules": [["<a>", {"type": "regex", "pattern": "b", "flags": "i"}]]},
            "format.rules[0][1].flags",
        ),
    ],
)
async def test_a_structural_tag_format_key_that_xgrammar_would_read_past_is_refused_naming_it(
    bundled: tuple[Any, Any], tag_format: dict[str, Any], path: str
) -> None:
    """xgrammar ignores a key its kind of format lacks: a misspelt bound would change nothing."""
    model, tokenizer = bundled
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        with pytest.raises(aiocb.InvalidRequestError, match="has no key") as caught:
            await manager.generate(
                "x", structural_tag={"type": "structural_tag", "format": tag_format}, max_new_tokens=4
            )
        assert caught.value.param == f"structural_tag.{path}"
        stats = manager.statistics()
        assert stats.free_blocks == stats.total_blocks


async def test_a_constraint_that_does_not_compile_carries_its_field(bundled: tuple[Any, Any]) -> None:
    model, tokenizer = bundled
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        for field, value in (("regex", "("), ("json_schema", {"type": "nope"}), ("bogus", 1)):
            with pytest.raises(aiocb.InvalidRequestError) as caught:
                await manager.generate("x", max_new_tokens=2, **{field: value})
            assert caught.value.param == field


def test_compiled_constraints_are_kept_within_a_memory_bound(
    bundled: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients may send any number of distinct constraints: beyond the bound the least
    recently used grammar is dropped (compiled again if it comes back)."""
    from aiocb import structured
    from aiocb.structured import GrammarCompiler

    model, tokenizer = bundled
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size)
    patterns = [("regex", f"{letter}[0-9]{{3}}") for letter in "abcd"]
    size = compiler.compile(patterns[0]).memory_size_bytes
    monkeypatch.setattr(structured, "CACHE_LIMIT_BYTES", int(size * 2.5))
    compiler.compile(patterns[1])
    compiler.compile(patterns[0])  # (used again: the most recent)
    compiler.compile(patterns[2])
    assert [compiler.is_cached(p) for p in patterns] == [True, False, True, False]
    compiler.compile(patterns[3])
    assert [compiler.is_cached(p) for p in patterns] == [False, False, True, True]


async def test_literals_too_long_to_compile_are_refused_at_once(bundled: tuple[Any, Any]) -> None:
    """A choice of 50,000 strings, or an enum of them (a 3 MB body), took minutes of a
    compile thread that other constraints wait for; past MAX_LITERAL_CHARACTERS they are
    refused by name, and a long enum under it is served."""
    from aiocb.params import MAX_LITERAL_CHARACTERS

    model, tokenizer = bundled
    many = [f"e{i}" * 10 for i in range(50_000)]
    split = {"type": "object", "properties": {"a": {"enum": many[:2000]}, "b": {"const": "x" * 60_000}}}  # (in all)
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        with pytest.raises(aiocb.InvalidRequestError, match=f"more than the {MAX_LITERAL_CHARACTERS}") as caught:
            await manager.generate("x", choice=many, max_new_tokens=4)
        assert caught.value.param == "choice"
        for schema in ({"enum": many}, split):
            with pytest.raises(aiocb.InvalidRequestError, match="its enum and const values hold") as caught:
                await manager.generate("x", json_schema=schema, max_new_tokens=4)
            assert caught.value.param == "json_schema"
        # (a structural tag's schemas together: its grammar holds them all)
        tags = [
            {
                "type": "tag",
                "begin": f"<{k}>",
                "content": {"type": "json_schema", "json_schema": {"enum": many[:1000]}},
                "end": f"</{k}>",
            }
            for k in range(4)
        ]
        tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": tags}}
        with pytest.raises(aiocb.InvalidRequestError, match="its schemas' enum and const values hold") as caught:
            await manager.generate("x", structural_tag=tag, max_new_tokens=4)
        assert caught.value.param == "structural_tag"
        served = await manager.generate("x", json_schema={"enum": many[:2000]}, max_new_tokens=60, temperature=0)
    assert json.loads(served.text or "") in many[:2000]


async def test_a_pattern_too_slow_to_compile_is_refused_at_once(bundled: tuple[Any, Any]) -> None:
    """A 47-byte schema whose pattern repeats a piece 50,000 times took four minutes of a
    compile thread (every other constraint waiting) to fail; refused by name before that."""
    import time

    model, tokenizer = bundled
    slow = {"type": "object", "properties": {"id": {"type": "string", "pattern": "[a-z]{1,50000}"}}}
    nested = {"type": "string", "pattern": "([a-z]{1,30}){1,30}"}
    # (Python's {,n} is 0 to n; a key of patternProperties is a pattern too: 12,000 took 12 s)
    zero_to = {"type": "string", "pattern": "^a{,12000}$"}
    keyed = {"type": "object", "patternProperties": {"^a{12000}$": {"type": "integer"}}}
    fine = {"type": "string", "pattern": "([a-z]{1,4}){1,3}"}
    cases = [
        (slow, "pattern at /properties/id", 50000),
        (nested, "pattern at /", 900),
        (zero_to, "pattern at /", 12000),
        (keyed, "patternProperties key at /", 12000),
    ]
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        for schema, where, repeats in cases:
            started = time.perf_counter()
            with pytest.raises(aiocb.InvalidRequestError) as caught:
                await manager.generate("x", json_schema=schema, max_new_tokens=4)
            assert time.perf_counter() - started < 5
            assert caught.value.param == "json_schema"
            assert f"the {where} repeats a piece {repeats} times" in str(caught.value)
        output = await manager.generate("x", json_schema=fine, max_new_tokens=40)
        assert output.finish_reason is aiocb.FinishReason.STOP
        assert re.fullmatch("[a-z]{1,12}", json.loads(output.text or ""))


async def test_the_vocabularys_grammar_tables_are_built_off_the_loop(
    bundled: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manager's first constrained request builds xgrammar's tables of the vocabulary
    (some 9 ms for 4,096 tokens, more for larger ones, the import the first time) on a
    worker thread, not on the loop."""
    from aiocb.engine import requests
    from aiocb.structured import GrammarCompiler

    threads: list[str] = []

    class Recorded(GrammarCompiler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            threads.append(threading.current_thread().name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(requests, "GrammarCompiler", Recorded)
    model, tokenizer = bundled
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate(PROMPTS[0], max_new_tokens=NEW, json_schema=SCHEMAS[0])
        await manager.generate(PROMPTS[1], max_new_tokens=NEW, regex="[ab]{3}")
    jsonschema.validate(json.loads(output.text or ""), SCHEMAS[0])
    assert len(threads) == 1 and threads[0] != threading.current_thread().name


async def test_a_constraint_given_as_a_dict_is_written_as_json_once_off_the_loop(
    bundled: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A structural tag of many tools' schemas took milliseconds to write as JSON, twice a
    request on the loop: a constraint not given as short text is checked on a worker
    thread, once; a short text on the loop."""
    from aiocb import params

    written: list[str] = []
    json_text = params._json_text

    def recorded(name: str, value: Any) -> str:
        written.append(threading.current_thread().name)
        return json_text(name, value)

    monkeypatch.setattr(params, "_json_text", recorded)
    model, tokenizer = bundled
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate(PROMPTS[0], max_new_tokens=NEW, temperature=0, json_schema=SCHEMAS[0])
        assert len(written) == 1 and written[0] != threading.current_thread().name
        text = json.dumps(SCHEMAS[0])
        again = await manager.generate(PROMPTS[0], max_new_tokens=NEW, temperature=0, json_schema=text)
        assert written[1:] == [threading.current_thread().name]
    jsonschema.validate(json.loads(output.text or ""), SCHEMAS[0])
    assert again.generated_tokens == output.generated_tokens


def test_a_regex_dot_matches_no_line_break_as_python_s(bundled: tuple[Any, Any]) -> None:
    """xgrammar's ``.`` matched any character: outputs of ``# .{10,40}`` held line breaks
    that ``re.fullmatch`` refuses. Escaped dots and dots in classes stay themselves."""
    import xgrammar

    from aiocb.structured import GrammarCompiler

    model, tokenizer = bundled
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size)
    for pattern, text in (
        ("a.b", "axb"),
        ("a.b", "a\nb"),
        (r"a\.b", "a.b"),
        (r"a\.b", "axb"),
        ("[.]x.", ".xy"),
        ("[.]x.", ".x\n"),
        (r"[\].]+.", "].\r"),
        (r"[\].]+.", "]\n"),
    ):
        matcher = xgrammar.GrammarMatcher(compiler.compile(("regex", pattern)))
        accepted = matcher.accept_string(text) and matcher.accept_token(min(compiler.stop_token_ids))
        assert accepted == (re.fullmatch(pattern, text) is not None), (pattern, text)


def test_re_escape_s_literals_match_themselves_and_log_nothing(
    bundled: tuple[Any, Any], capfd: pytest.CaptureFixture[str]
) -> None:
    """``re.escape`` escapes spaces, line breaks, ``#``, ``&`` and ``~``, which xgrammar
    matched as themselves but warned of on stderr, once for every pattern compiled."""
    import xgrammar

    from aiocb.structured import GrammarCompiler

    model, tokenizer = bundled
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size)
    literal = "a b\tc\nd#e&f~g\rh\x0bi\x0cj"
    members = re.escape(" #&~\n\r\t\x0b\x0c")
    for pattern, text, matches in (
        (re.escape(literal), literal, True),
        (re.escape(literal), literal.replace(" ", "x"), False),
        (f"[{members}]+", " #~&\r\n\x0c\x0b\t", True),
        (f"[{members}]+", " x", False),
        (f"[^{members}]", "\n", False),
        (r"\\ ", "\\ ", True),
    ):
        matcher = xgrammar.GrammarMatcher(compiler.compile(("regex", pattern)))
        accepted = matcher.accept_string(text) and matcher.accept_token(min(compiler.stop_token_ids))
        assert accepted == matches == (re.fullmatch(pattern, text) is not None), (pattern, text)
    assert "not recognized" not in capfd.readouterr().err


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"type": "integer", "enum": [1, 7], "minimum": 5}, "'minimum' at / (beside 'enum'"),
        ({"type": "string", "enum": ["ok", "toolong"], "maxLength": 3}, "'maxLength' at / (beside 'enum'"),
        ({"type": "string", "const": "abc", "maxLength": 2}, "'maxLength' at / (beside 'const'"),
        ({"type": "integer", "enum": [1, "a"]}, "'enum' at / (its 'a' is not of its 'type'"),
        # (an ECMA pattern, which Python's re reads otherwise: "$" before a line break, "\d")
        ({"enum": ["a\n"], "pattern": "^a$"}, "'pattern' at / (beside 'enum'"),
        # (draft 4's boolean exclusive bound)
        ({"enum": [2], "minimum": 2, "exclusiveMinimum": True}, "'exclusiveMinimum' at / (beside 'enum'"),
    ],
)
async def test_an_enum_or_const_beside_what_the_grammar_leaves_out_is_refused(
    bundled: tuple[Any, Any], schema: dict[str, Any], problem: str
) -> None:
    """xgrammar takes an enum's values alone: outputs broke the keywords beside them."""
    model, tokenizer = bundled
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        with pytest.raises(aiocb.InvalidRequestError, match=re.escape(problem)):
            await manager.generate("x", json_schema=schema, max_new_tokens=4)
        # (the values of its type, with annotations, extensions and keywords they all pass: served)
        for served in (
            {"type": "string", "enum": ["ok", "no"], "title": "Answer", "description": "d"},
            {"type": "string", "enum": ["ok", "no"], "enumDescriptions": ["yes", "no"], "x-enum-varnames": ["A", "B"]},
            {"$id": "answer", "enum": ["ok", "no"], "maxLength": 2},
        ):
            output = await manager.generate("x", json_schema=served, max_new_tokens=8)
            assert json.loads(output.text or "") in ("ok", "no")


@pytest.mark.parametrize(
    "keyword",
    [
        {"uniqueItems": False},
        {"propertyNames": {"type": "string"}},
        {"dependentRequired": {}},
        {"minContains": 0},
        {"unevaluatedProperties": True},
    ],
)
async def test_a_keyword_that_constrains_nothing_is_served(bundled: tuple[Any, Any], keyword: dict[str, Any]) -> None:
    """Its grammar is rightly the grammar without it: it was refused as left out."""
    model, tokenizer = bundled
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], **keyword}
    if "uniqueItems" in keyword or "minContains" in keyword:
        schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 2, **keyword}
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        await manager.generate("x", json_schema=schema, max_new_tokens=4)


async def test_a_constraint_that_allows_no_text_says_so(bundled: tuple[Any, Any]) -> None:
    """Its error named controls the request never set."""
    model, tokenizer = bundled
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate("x", grammar="root ::= [^\\x00-\\U0010FFFF]", max_new_tokens=4)
    assert output.finish_reason == aiocb.FinishReason.ERROR
    assert (
        output.error
        == "no token satisfies the request's output constraint at this point: its grammar allows no text here"
    )


def _optional_integers(count: int) -> str:
    """A schema of ``count`` optional integer properties: xgrammar's compile time grows
    fast with them (1,000 took 12 s on a 2-core machine, 2,000 minutes)."""
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}})


def _children(ignored: frozenset[int] = frozenset()) -> list[Any]:
    """This process's live grammar processes (the children that compile constraints first),
    but the ``ignored`` ones (other tests' managers share theirs)."""
    children = [c for c in psutil.Process().children() if c.pid not in ignored]
    return [c for c in children if c.status() != psutil.STATUS_ZOMBIE and "grammar_process" in " ".join(c.cmdline())]


def test_the_grammar_process_answers_and_is_killed_past_the_deadline(
    bundled: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child makes and compiles a constraint as the engine's process does (its refusal's
    message if it does not compile), is killed past the deadline (the constraint then
    refused at once under a deadline as short, tried again under a longer one), and is
    ended once idle; another starts for the next constraint."""
    from aiocb import grammar_process
    from aiocb.grammar_process import CompileFailed, CompileTimeout, GrammarProcesses

    monkeypatch.setattr(grammar_process, "IDLE_EXIT_S", 1.0)
    others = frozenset(c.pid for c in _children())
    _, tokenizer = bundled
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    processes = GrammarProcesses(info.serialize_json(), 1)
    slow = _optional_integers(2000)
    # (xgrammar's printed form of this grammar loses the text after the NUL, and is refused)
    nul = 'root ::= item "\\x00" | "' + "y" * 2100 + '"\nitem ::= "x" (= "\\x00")\n'
    try:
        assert processes.compiles("regex", "[a-z]{1,8}", 30.0) is None
        assert processes.compiles("grammar", nul, 30.0) is None
        refused = processes.compiles("grammar", 'root ::= "a" | other', 30.0)
        assert refused is not None and refused.startswith("grammar cannot be compiled")
        assert 'Rule "other" is not defined' in refused
        for deadline in (1.0, 1.5):  # (the second: not refused for the first's shorter deadline)
            began = time.monotonic()
            with pytest.raises(CompileTimeout):
                processes.compiles("json_schema", slow, deadline)
            assert deadline <= time.monotonic() - began < deadline + 20  # (killed at the deadline, and a start)
            assert not _children(others)
        began = time.monotonic()
        with pytest.raises(CompileTimeout):  # (remembered: refused again without a compile)
            processes.compiles("json_schema", slow, 1.5)
        assert time.monotonic() - began < 0.1
        tag = json.dumps({"format": {"type": "const_string", "value": "x"}})
        assert processes.compiles("structural_tag", tag, 30.0) is None
        assert len(_children(others)) == 1  # (another child, started for it)
        idle_for = time.monotonic() + 10.0
        while _children(others) and time.monotonic() < idle_for:
            time.sleep(0.1)
        assert not _children(others)  # (idle: it was ended)
        # A child that ends while it compiles (a crash, the out-of-memory killer) fails
        # that constraint's compile: it would have failed the engine's process.
        assert processes.compiles("regex", "[a-z]{1,9}", 30.0) is None  # (a child started again)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            compiling = pool.submit(processes.compiles, "json_schema", _optional_integers(1999), 60.0)
            time.sleep(0.5)
            _children(others)[0].kill()
            with pytest.raises(CompileFailed, match="ended with status -9"):
                compiling.result()
    finally:
        processes.close()
    assert not _children(others)


def test_a_grammar_process_ends_with_its_parent(bundled: tuple[Any, Any], tmp_path: Path) -> None:
    """A child whose parent is killed while it compiles ends within seconds, not when its
    compile does (minutes)."""
    _, tokenizer = bundled
    info = tmp_path / "info.json"
    info.write_text(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)).serialize_json())
    script = tmp_path / "parent.py"
    script.write_text(
        "import pathlib, sys\n"
        "from aiocb.grammar_process import GrammarProcesses\n"
        f"processes = GrammarProcesses(pathlib.Path({str(info)!r}).read_text(), 1)\n"
        "processes.compiles('regex', 'a', 60.0)\n"
        "print('ready', flush=True)\n"
        f"processes.compiles('json_schema', {_optional_integers(2000)!r}, 600.0)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(aiocb.__file__).parent.parent)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"ready\n"
        child = psutil.Process(parent.pid).children()[0]
        time.sleep(0.5)  # (compiling)
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    child.wait(timeout=10)  # (psutil.TimeoutExpired if it went on compiling)


async def test_a_constraint_past_the_compile_timeout_is_refused_and_harms_no_other_request(
    bundled: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long constraint compiles in a child process first: past ``grammar_compile_timeout``
    the child and its compile are killed and the request refused naming the constraint;
    requests beside it, and long constraints after it, are served."""
    from aiocb import grammar_process
    from aiocb.structured import PROBED_ABOVE

    monkeypatch.setattr(grammar_process, "_SHARED", {})  # (children of its own, not other tests')
    model, tokenizer = bundled
    words = [f"word{i:04}" for i in range(300)]
    quick = json.dumps({"enum": words})
    assert len(quick) > PROBED_ABOVE
    config = aiocb.ContinuousBatchingConfig(num_blocks=256, grammar_compile_timeout=1.0)
    others = frozenset(c.pid for c in _children())
    async with aiocb.Manager(model, tokenizer=tokenizer, continuous_batching_config=config) as manager:
        greedy = {"max_new_tokens": 24, "ignore_eos": True, "do_sample": False}
        alone = await manager.generate("def f(x):", **greedy)
        free = asyncio.create_task(manager.generate("def f(x):", **greedy))
        for _ in range(2):  # (the second refused at once: it was found too slow)
            began = time.monotonic()
            with pytest.raises(aiocb.InvalidRequestError, match="grammar_compile_timeout") as caught:
                await manager.generate("x = ", json_schema=_optional_integers(2000), max_new_tokens=8)
            assert caught.value.param == "json_schema"
            assert time.monotonic() - began < 30.0  # (a child's start, then the second's deadline)
            assert not _children(others)  # (the child compiling it was killed)
        assert (await free).generated_tokens == alone.generated_tokens
        output = await manager.generate("x = ", json_schema=quick, max_new_tokens=NEW)
        assert json.loads(output.text) in words
        assert manager.statistics().free_blocks == 256


async def test_constraints_compile_in_process_when_no_child_starts(
    bundled: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from aiocb import grammar_process

    def no_child(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no interpreter here")

    monkeypatch.setattr(grammar_process.subprocess, "Popen", no_child)
    monkeypatch.setattr(grammar_process, "_SHARED", {})  # (none of other managers' children)
    model, tokenizer = bundled
    words = [f"word{i:04}" for i in range(300)]
    async with aiocb.Manager(model, tokenizer=tokenizer) as manager:
        output = await manager.generate("x = ", json_schema=json.dumps({"enum": words}), max_new_tokens=NEW)
    assert json.loads(output.text) in words
    assert "no interpreter here" in caplog.text and "with no deadline" in caplog.text
