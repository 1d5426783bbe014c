"""The server tests' tiny model and tokenizer, for the replicas' tests."""

from tests.server.conftest import model, model_dir, tokenizer, tokenizer_dir

__all__ = ["model", "model_dir", "tokenizer", "tokenizer_dir"]
