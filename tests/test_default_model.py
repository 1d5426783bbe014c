"""The packaged default model: a normal Hugging Face folder that learnt some Python and the
shape of a chat."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase, Qwen3ForCausalLM

from aiocb import default_model
from aiocb.default_model import DEFAULT_MODEL_PATH, HELD_OUT_FILES, load_default_model

CONTEXT = 1024
#: Held-out windows scored (8192 tokens): enough for a stable mean, quick on a CPU.
EVAL_WINDOWS = 8
#: The packaged model scores 4.29 nats/token here (Python 3.11 stdlib), a random one 8.33;
#: the margin covers other Python versions' files and a retrained model.
MAX_HELD_OUT_LOSS = 4.8


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_PATH).eval()


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)


def _training_script() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "scripts" / "train_default_model.py"
    spec = importlib.util.spec_from_file_location("train_default_model", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclasses look their module up in sys.modules.
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def _held_out_ids(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in HELD_OUT_FILES:
        ids += [*tokenizer.encode((stdlib / name).read_text(encoding="utf-8")), tokenizer.eos_token_id]
    windows = [ids[i : i + CONTEXT] for i in range(0, len(ids) - CONTEXT + 1, CONTEXT)]
    assert len(windows) >= EVAL_WINDOWS
    # Spread over all the files: textwrap.py alone, mostly docstrings, would not be typical.
    return torch.tensor([windows[i * len(windows) // EVAL_WINDOWS] for i in range(EVAL_WINDOWS)])


@torch.no_grad()
def _mean_loss(model: PreTrainedModel, windows: torch.Tensor) -> float:
    return float(model(input_ids=windows, labels=windows).loss)  # the model shifts the labels itself


def test_folder_is_complete_and_small() -> None:
    names = {p.name for p in DEFAULT_MODEL_PATH.iterdir()}
    for required in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert required in names
    total = sum(p.stat().st_size for p in DEFAULT_MODEL_PATH.iterdir() if p.is_file())
    assert total < 10 * 2**20, f"{DEFAULT_MODEL_PATH} holds {total / 2**20:.1f} MiB"


def test_auto_classes_load_a_small_fp32_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    assert model.config.model_type == "qwen3"
    assert model.dtype == torch.float32  # stored in bf16, upcast on load (config.dtype)
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.eos_token == "<|endoftext|>"
    eos = tokenizer.eos_token_id
    assert model.config.eos_token_id == model.generation_config.pad_token_id == eos
    assert model.config.max_position_embeddings == CONTEXT
    assert tokenizer.decode(tokenizer.encode("def f(x):\n\treturn x  # é")) == "def f(x):\n\treturn x  # é"


def test_greedy_continuation_is_printable_text(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = tokenizer.encode("class Config:\n    def __init__(self")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=32,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    text = tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)
    assert text.strip()
    assert all(ch.isascii() and (ch.isprintable() or ch in "\n\t") for ch in text), repr(text)
    assert any(ch.isalpha() for ch in text), repr(text)


def test_held_out_loss_is_far_below_a_random_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    windows = _held_out_ids(tokenizer)
    trained = _mean_loss(model, windows)
    torch.manual_seed(0)
    untrained = _mean_loss(type(model)(model.config).eval(), windows)
    assert trained < 0.6 * untrained, (trained, untrained)
    assert trained < MAX_HELD_OUT_LOSS, trained


def test_held_out_files_are_not_trained_on() -> None:
    script = _training_script()
    root = script.stdlib_root()
    files = {p.relative_to(root).as_posix() for p in script.training_files(root)}
    assert len(files) > 100
    assert not files & set(HELD_OUT_FILES)
    assert not any("/test/" in f"/{name}" or "/tests/" in f"/{name}" for name in files)


def test_load_default_model() -> None:
    model, tokenizer = load_default_model()
    assert not model.training
    assert model.device.type == "cpu"
    assert model.dtype == torch.float32
    assert tokenizer.eos_token_id == model.config.eos_token_id


def test_a_missing_default_model_says_how_to_build_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PATH", tmp_path / "pycode-tiny")
    with pytest.raises(FileNotFoundError, match=r"lacks config\.json.*python scripts/train_default_model\.py"):
        default_model.load_default_model()
    with pytest.raises(FileNotFoundError, match=r"train_default_model\.py --output"):
        load_default_model(path=tmp_path)


# --- chat -------------------------------------------------------------------------------

#: The added tokens and their ids: each is one token wherever it appears, so that generation
#: can stop on one and a tool-call parser can find them in the ids as well as in the text.
ADDED_TOKENS = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<tool_call>": 3,
    "</tool_call>": 4,
    "<tool_response>": 5,
    "</tool_response>": 6,
    "<think>": 7,
    "</think>": 8,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "dedent",
            "description": "Remove any common leading whitespace from every line in `text`.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "shorten",
            "description": "Collapse and truncate the given text to fit in the given width.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}, "width": {"type": "integer"}},
                "required": ["text", "width"],
            },
        },
    },
]
TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)
#: Sampled answers (of 8 seeds) to a short coding request that end their turn with
#: <|im_end|> within 300 tokens: the packaged model ends 6, an untrained one none.
MIN_CHAT_ENDINGS = 3
#: Sampled answers (of 8 seeds) to a request for a tool that are one well-formed call and
#: the end of the turn: the packaged model gives 8, an untrained one none.
MIN_TOOL_CALLS = 5
#: One Hermes-style call (whatever it calls: the model is too small to pick the right tool).
TOOL_CALL = re.compile(r'<tool_call>\n\{"name": "[^"\n]+", "arguments": [^\n]*\}\n</tool_call><\|im_end\|>')


def test_added_tokens_are_single_ids(tokenizer: PreTrainedTokenizerBase) -> None:
    for token, token_id in ADDED_TOKENS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(token) == [token_id]
        assert token_id in tokenizer.encode(f"x = 1{token}\ny = 2")
    assert len(tokenizer) == 4096


def test_skip_special_tokens_drops_the_turn_delimiters_but_keeps_the_markup(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    text = '<|im_start|>assistant\n<think>\nhm\n</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ids = tokenizer.encode(text + "<|im_end|>\n<|endoftext|>")
    assert tokenizer.decode(ids) == text + "<|im_end|>\n<|endoftext|>"
    kept = tokenizer.decode(ids, skip_special_tokens=True)
    assert kept == text.removeprefix("<|im_start|>") + "\n"
    assert tokenizer.decode([5, 6], skip_special_tokens=True) == "<tool_response></tool_response>"
    assert set(tokenizer.all_special_tokens) == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}


def test_generation_stops_at_the_end_of_a_document_or_a_turn(model: PreTrainedModel) -> None:
    assert model.generation_config.eos_token_id == [ADDED_TOKENS["<|endoftext|>"], ADDED_TOKENS["<|im_end|>"]]


def test_chat_template_renders_chatml_turns(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write `f()`."},
        {"role": "assistant", "content": "def f():\n    pass"},
        {"role": "user", "content": "Thanks."},
    ]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWrite `f()`.<|im_end|>\n"
        "<|im_start|>assistant\ndef f():\n    pass<|im_end|>\n"
        "<|im_start|>user\nThanks.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages[1:2], tokenize=False) == "<|im_start|>user\nWrite `f()`.<|im_end|>\n"


def test_chat_template_puts_the_tools_in_the_system_message(tokenizer: PreTrainedTokenizerBase) -> None:
    user = {"role": "user", "content": "Dedent this."}
    tools_json = "\n".join(json.dumps(tool) for tool in TOOLS)
    merged = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, user], tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert merged == (
        f"<|im_start|>system\nBe brief.{TOOLS_PREAMBLE}{tools_json}{TOOLS_POSTAMBLE}"
        "<|im_start|>user\nDedent this.<|im_end|>\n<|im_start|>assistant\n"
    )
    alone = tokenizer.apply_chat_template([user], tools=TOOLS, tokenize=False)
    assert isinstance(alone, str)
    assert alone.startswith("<|im_start|>system\n")
    assert alone.count("<|im_start|>system\n") == 1
    assert f"{TOOLS_PREAMBLE}{tools_json}{TOOLS_POSTAMBLE}<|im_start|>user\nDedent this.<|im_end|>\n" in alone


def test_chat_template_renders_tool_calls_and_tool_responses(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "user", "content": "Shorten two texts."},
        {
            "role": "assistant",
            "content": "Calling shorten twice.",
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "shorten", "arguments": {"text": "x", "width": 5}},
                },
                {"id": "b", "type": "function", "function": {"name": "shorten", "arguments": '{"text": "y"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": '"x"'},
        {"role": "tool", "tool_call_id": "b", "content": '"y"'},
        {"role": "assistant", "content": "Done."},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "dedent", "arguments": {}}}]},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert isinstance(text, str)
    assert (
        "<|im_start|>assistant\nCalling shorten twice."
        '\n<tool_call>\n{"name": "shorten", "arguments": {"text": "x", "width": 5}}\n</tool_call>'
        '\n<tool_call>\n{"name": "shorten", "arguments": {"text": "y"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n"x"\n</tool_response>\n<tool_response>\n"y"\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nDone.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "dedent", "arguments": {}}\n</tool_call><|im_end|>\n'
    ) in text
    assert text.endswith("</tool_call><|im_end|>\n")


def test_a_two_tool_prompt_leaves_room_for_a_long_answer(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "Shorten 'The quick brown fox jumps over the lazy dog' to 20 characters."}]
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    answer = {"name": "shorten", "arguments": {"text": " ".join(f"word{i}" for i in range(80)), "width": 20}}
    call = f"<tool_call>\n{json.dumps(answer)}\n</tool_call><|im_end|>"
    assert len(tokenizer.encode(call)) >= 200
    assert len(tokenizer.encode(prompt + call)) <= CONTEXT


def test_sampled_chat_answers_end_their_turn(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "Write a function `is_even(n)` that does this: return True if n is even."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(prompt)])
    im_end = ADDED_TOKENS["<|im_end|>"]
    ended = 0
    for seed in range(8):
        torch.manual_seed(seed)
        with torch.no_grad():  # the generation config's sampling; it stops at <|im_end|>
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=300)
        answer = out[0, ids.shape[1] :].tolist()
        ended += len(answer) > 1 and answer[-1] == im_end  # an empty answer does not count
    assert ended >= MIN_CHAT_ENDINGS, ended


def test_sampled_answers_to_a_tool_request_are_tool_calls(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    messages = [{"role": "user", "content": 'Call shorten with text="hello world", width=5.'}]
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(prompt)])
    calls = 0
    for seed in range(8):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=100)
        calls += TOOL_CALL.fullmatch(tokenizer.decode(out[0, ids.shape[1] :])) is not None
    assert calls >= MIN_TOOL_CALLS, calls


def test_the_copying_circuit_alone_copies_a_repeated_sequence() -> None:
    # The circuit the training starts from, with every other head and MLP of an untrained
    # model silenced: random token sequences written twice, the second copy predicted.
    script = _training_script()
    circuit = importlib.import_module("copying_circuit")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(script.model_config(4096, 0)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.zero_()
            layer.self_attn.o_proj.weight.zero_()
    circuit.hold_circuit(model, circuit.copying_circuit(model.config, seed=0))
    generator = torch.Generator().manual_seed(1)
    for half in (20, 200):
        first = torch.randint(1, 4096, (4, half), generator=generator)
        ids = torch.cat([first, first], dim=1)
        with torch.no_grad():
            predicted = model(ids).logits[:, half:-1].argmax(-1)
        assert (predicted == ids[:, half + 1 :]).float().mean() > 0.9


def test_the_model_copies_from_its_context(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    # Held-out functions written twice: the model predicts the second copy far better than
    # the first (its copying circuit). The packaged model: 4.25 nats per token on the first
    # copies, 3.07 on the second (17 functions); one trained without the circuit: 4.19, 4.05.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    first, second = [], []
    for name in HELD_OUT_FILES:
        source = (stdlib / name).read_text(encoding="utf-8")
        for node in ast.parse(source).body:
            text = ast.get_source_segment(source, node) if isinstance(node, ast.FunctionDef) else None
            length = len(tokenizer.encode(text)) if text is not None else 0
            if not 60 <= length <= 400:
                continue
            once = len(tokenizer.encode(f"{text}\n\n\n"))
            ids = tokenizer.encode(f"{text}\n\n\n{text}")
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
            first.append(loss[: length - 1].mean())
            second.append(loss[once:].mean())
    assert len(first) >= 8
    assert sum(second) / len(second) < sum(first) / len(first) - 0.6, (first, second)
