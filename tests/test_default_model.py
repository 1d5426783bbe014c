"""The packaged default model: a normal Hugging Face folder that learnt some Python."""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from aiocb import default_model
from aiocb.default_model import DEFAULT_MODEL_PATH, HELD_OUT_FILES, load_default_model

CONTEXT = 256
#: Held-out windows scored (4096 tokens): enough for a stable mean, quick on a CPU.
EVAL_WINDOWS = 16
#: The packaged model scores 4.12 nats/token here (Python 3.11 stdlib), a random one 8.35;
#: the margin covers other Python versions' files and a retrained model.
MAX_HELD_OUT_LOSS = 4.6


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
    spec.loader.exec_module(module)
    return module


def _held_out_ids(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in HELD_OUT_FILES:
        ids += [*tokenizer.encode((stdlib / name).read_text(encoding="utf-8")), tokenizer.eos_token_id]
    windows = [ids[i : i + CONTEXT] for i in range(0, len(ids) - CONTEXT + 1, CONTEXT)]
    # Spread over all the files: textwrap.py alone, mostly docstrings, would not be typical.
    picked = windows[:: max(1, len(windows) // EVAL_WINDOWS)][:EVAL_WINDOWS]
    assert len(picked) == EVAL_WINDOWS
    return torch.tensor(picked)


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
    assert model.config.eos_token_id == model.generation_config.eos_token_id == eos
    assert model.generation_config.pad_token_id == eos
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
