"""A tiny Llama saved to disk, for the ranks to load with tensor parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedModel

from tests.conftest import tiny_llama


@pytest.fixture(scope="module")
def llama_model() -> PreTrainedModel:
    """4 attention heads and 2 KV heads: tp_size 2 splits them."""
    return tiny_llama()


@pytest.fixture(scope="module")
def llama_dir(llama_model: PreTrainedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    llama_model.save_pretrained(path)
    return path
