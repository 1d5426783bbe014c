"""``aiocb.SamplingParams``: one typed, frozen, validated source of every request control."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import aiocb
from aiocb.params import FIELD_NAMES, parameter_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_parameter_table_is_generated_from_the_class() -> None:
    text = README.read_text()
    match = re.search(r"<!-- parameters:[^\n]*-->\n(.*?)\n<!-- end of parameters -->", text, re.S)
    assert match is not None, "the README lost its generated parameter table"
    assert match.group(1) == parameter_table(), "regenerate it with aiocb.params.parameter_table()"
    for name in FIELD_NAMES:
        assert f"| `{name}` |" in match.group(1)


def test_values_are_normalised_and_frozen() -> None:
    params = aiocb.SamplingParams(
        stop="\n\n",
        logit_bias={"7": 2, 3: -1.5},
        sequence_bias={(1, 2): -1.0, 5: 2.0},
        bad_words_ids=[[4], (8, 9)],
        stop_token_ids=[2],
        eos_token_id=-1,
        temperature=1,
    )
    assert params.stop == ("\n\n",)
    assert params.logit_bias == ((3, -1.5), (7, 2.0))
    assert params.sequence_bias == (((1, 2), -1.0), ((5,), 2.0))
    assert params.bad_words_ids == ((4,), (8, 9))
    assert params.stop_token_ids == (2,) and params.eos_token_id == (-1,)
    assert params.temperature == 1.0 and isinstance(params.temperature, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 2.0  # type: ignore[misc]
    assert params.updated(top_k=3, seed=None) == dataclasses.replace(params, top_k=3)
    assert params.given().keys() >= {"stop", "logit_bias", "temperature"}


class _BadIndex:
    """An object whose ``__index__`` fails other than with TypeError."""

    def __index__(self) -> int:
        raise ValueError("no index here")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"top_k": 2.0}, "top_k must be an int"),
        ({"temperature": "hot"}, r"temperature must be a number \(an int or a float\), got 'hot'"),
        ({"temperature": torch.tensor(0.5)}, "temperature must be a number"),
        ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
        ({"temperature": 10**400}, "temperature must be a finite number, got 1000"),
        ({"seed": 10**5000}, "seed must be <= 18446744073709551615, got an integer of 16610 bits"),
        # (a 0-d tensor or array is iterable by its type, and refuses when iterated)
        ({"allowed_token_ids": torch.tensor(5)}, "allowed_token_ids must be a list of token ids, got Tensor"),
        ({"stop_token_ids": np.array(5)}, "stop_token_ids must be a list of token ids, got ndarray"),
        ({"bad_words_ids": torch.tensor(5)}, "bad_words_ids must be a list of lists"),
        ({"bad_words_ids": [np.array(5)]}, "bad_words_ids must be a list of lists"),
        ({"logit_bias": np.array(5)}, "logit_bias must map token ids to biases"),
        ({"sequence_bias": [(torch.tensor(5), 1.0), torch.tensor(2)]}, "sequence_bias must map .* got the item"),
        ({"top_p": 0.0}, r"top_p must be in \(0.0, 1.0\]"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"ignore_eos": 1}, "ignore_eos must be True or False"),
        ({"stop": [1]}, "stop must hold strings"),
        ({"stop": b"x"}, "stop must be a string or a list of strings"),
        ({"logit_bias": {"a": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {-(10**5000): 1}}, "logit_bias keys must be token ids, got an integer of 16610 bits"),
        ({"logit_bias": {10**5000: 1}}, "logit_bias keys must be token ids, got an integer of 16610 bits"),
        (
            {"structural_tag": {"type": "structural_tag", "format": {}, "triggers": []}},
            r"unknown key\(s\) \['triggers'\]",
        ),
        ({"structural_tag": {"structures": [{"begin": "a", "schema": {}, "end": "b", "x": 1}]}}, r"structures\[0\]"),
        ({"sequence_bias": {(): 1.0}}, "sequence_bias is empty"),
        ({"bad_words_ids": [[]]}, "bad_words_ids is empty"),
        # (long lists are checked a few C-level passes at a time, and still name what is wrong)
        ({"bad_words_ids": [[1, 2]] * 5000 + [[3, "4"]]}, "bad_words_ids must hold token ids.*'4'"),
        ({"bad_words_ids": [[1, 2]] * 5000 + [[3, -4]]}, r"bad_words_ids holds a negative token id \(-4\)"),
        ({"bad_words_ids": [[1, 2]] * 5000 + [[]]}, "bad_words_ids is empty"),
        ({"bad_words_ids": [[1, 2]] * 5000 + [7]}, "list of lists"),
        ({"allowed_token_ids": [*range(100_000), True]}, "allowed_token_ids must hold token ids.*True"),
        ({"logit_bias": {**dict.fromkeys(range(5000), 1.0), 9: float("nan")}}, r"logit_bias\[9\] must be a number"),
        ({"logit_bias": {**dict.fromkeys(range(5000), 1.0), 7: 100.5}}, r"logit_bias\[7\] must be a number"),
        ({"logit_bias": {**dict.fromkeys(range(5000), 1.0), -3: 1.0}}, "logit_bias keys must be token ids, got -3"),
        ({"stop_token_ids": [torch.empty((), dtype=torch.long, device="meta")]}, "stop_token_ids must hold token ids"),
        ({"stop_token_ids": [_BadIndex()]}, "stop_token_ids must hold token ids"),
        ({"stop_token_ids": [-3]}, "stop_token_ids holds a negative token id"),
        ({"timeout": 0}, "timeout must be in"),
    ],
)
def test_bad_values_name_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(aiocb.InvalidRequestError, match=message):
        aiocb.SamplingParams(**fields)  # type: ignore[arg-type]


def test_a_logit_bias_keyed_as_json_reads_as_one_keyed_by_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON object keys (every client's) are read in C passes, as ints are (matched key by
    key, 4,000 held the loop 4 ms); a key written otherwise than ``str(id)`` is read key by
    key, the last of two naming one id winning."""
    from aiocb import params

    matched: list[str] = []
    pattern = params._DECIMAL

    class Counted:
        def fullmatch(self, text: str) -> object:
            matched.append(text)
            return pattern.fullmatch(text)

    monkeypatch.setattr(params, "_DECIMAL", Counted())
    rng = random.Random(0)
    biases = {token: rng.uniform(-5, 5) for token in rng.sample(range(200_000), 9_000)}
    as_json = {str(token): bias for token, bias in biases.items()}
    assert aiocb.SamplingParams(logit_bias=as_json).logit_bias == tuple(sorted(biases.items()))
    assert not matched
    assert aiocb.SamplingParams(logit_bias={"05": 1, "5": 2, "7": 3}).logit_bias == ((5, 2.0), (7, 3.0))
    assert aiocb.SamplingParams(logit_bias={"5": 2, "05": 1}).logit_bias == ((5, 1.0),)
    mixed = {**{str(token): 1.0 for token in range(9_000)}, 5: -1.0}  # (an id twice, across slices)
    assert dict(aiocb.SamplingParams(logit_bias=mixed).logit_bias or ())[5] == -1.0
    for key in ("-1", "+5", " 5", "\u0665", "1" * 30, ""):
        with pytest.raises(aiocb.InvalidRequestError, match="logit_bias keys must be token ids"):
            aiocb.SamplingParams(logit_bias={"3": 1.0, key: 1.0})


def test_a_sequence_bias_in_its_common_forms_is_read_in_c_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mapping of id tuples or a list of ``[ids, bias]`` pairs is checked in C passes
    (item by item, 900 cost 2-3 ms on the loop), as the item-by-item check reads it."""
    from aiocb import params

    read: list[object] = []
    ids = params._ids
    monkeypatch.setattr(params, "_ids", lambda *args, **kwargs: read.append(args) or ids(*args, **kwargs))
    mapping = {((i * 7) % 4000, (i * 13) % 4000 + 1): -2.0 - i % 3 for i in range(900)}
    pairs = [[list(key), bias] for key, bias in mapping.items()] + [[[0, 1], float("-inf")], [(0, 1), 3]]
    expected = tuple({**mapping, (0, 1): 3.0}.items())  # (the last bias given, in the first place)
    assert aiocb.SamplingParams(sequence_bias=mapping).sequence_bias == tuple(mapping.items())
    assert aiocb.SamplingParams(sequence_bias=pairs).sequence_bias == expected
    assert not read
    for bias, problem in (
        (float("nan"), "must be a number"),
        (True, "must be a number"),
        (1e39, "at most"),
        (-(10**400), "within float32's range"),  # (past a float's: OverflowError before)
    ):
        with pytest.raises(aiocb.InvalidRequestError, match=problem):
            aiocb.SamplingParams(sequence_bias={**mapping, (3, 4): bias})
    for key, problem in (((-1, 2), "negative token id"), ((), "is empty")):
        with pytest.raises(aiocb.InvalidRequestError, match=problem):
            aiocb.SamplingParams(sequence_bias={**mapping, key: 1.0})


def test_numpy_numbers_are_biases_as_the_floats_they_hold() -> None:
    """A NumPy number is a bias as any other field takes one (a NumPy bool is no number)."""
    import numpy as np

    for bias in (np.float32(2.0), np.float16(2.0), np.int64(2)):
        assert aiocb.SamplingParams(logit_bias={3: bias}).logit_bias == ((3, 2.0),)
        assert aiocb.SamplingParams(sequence_bias={(3, 4): -bias}).sequence_bias == (((3, 4), -2.0),)
    for bias, problem in ((np.float32("nan"), "must be a number"), (np.bool_(True), "must be a number")):
        with pytest.raises(aiocb.InvalidRequestError, match=problem):
            aiocb.SamplingParams(sequence_bias={(3, 4): bias})
    for bias in (np.float32(101.0), np.bool_(True), np.float32("nan")):
        with pytest.raises(aiocb.InvalidRequestError, match=r"logit_bias\[3\] must be a number in \[-100, 100\]"):
            aiocb.SamplingParams(logit_bias={3: bias})


def test_unknown_names_are_refused() -> None:
    with pytest.raises(aiocb.InvalidRequestError, match=r"unknown request parameter.*temprature"):
        aiocb.SamplingParams().updated(temprature=0.5)
    with pytest.raises(TypeError):
        aiocb.SamplingParams(temprature=0.5)  # type: ignore[call-arg]


def test_a_schema_nested_past_pythons_recursion_limit_is_refused_by_name() -> None:
    deep: dict[str, object] = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    for given in (deep, "[" * 100_000 + "]" * 100_000):
        with pytest.raises(aiocb.InvalidRequestError, match="json_schema") as caught:
            aiocb.SamplingParams(json_schema=given)
        assert caught.value.param == "json_schema"


def test_numpy_and_tensor_integers_are_taken_as_the_ints_they_hold() -> None:
    params = aiocb.SamplingParams(
        eos_token_id=np.int64(3),
        stop_token_ids=list(np.array([4, 5])),
        logit_bias={np.int32(6): 1.5},
        sequence_bias={np.int64(7): -1.0},
        bad_words_ids=[list(torch.tensor([8, 9]))],
    )
    assert params.eos_token_id == (3,) and params.stop_token_ids == (4, 5)
    assert params.logit_bias == ((6, 1.5),) and params.sequence_bias == (((7,), -1.0),)
    assert params.bad_words_ids == ((8, 9),)
    fields = (params.eos_token_id, params.stop_token_ids, params.logit_bias, params.bad_words_ids)
    assert all(type(i) is int for i in (*fields[0], *fields[1], fields[2][0][0], *fields[3][0]))
    # So are numbers: an integer field's NumPy or tensor integer, a float field's NumPy float.
    numbers = aiocb.SamplingParams(max_new_tokens=np.int32(7), top_k=torch.tensor(3), temperature=np.float32(0.5))
    assert (numbers.max_new_tokens, numbers.top_k, numbers.temperature) == (7, 3, 0.5)
    assert (type(numbers.max_new_tokens), type(numbers.top_k), type(numbers.temperature)) == (int, int, float)
    with pytest.raises(aiocb.InvalidRequestError, match=r"top_k must be an int, got np\.float32"):
        aiocb.SamplingParams(top_k=np.float32(3))
    with pytest.raises(aiocb.InvalidRequestError, match="bad_words_ids must be a list of lists"):
        aiocb.SamplingParams(bad_words_ids=[np.int64(3)])
