"""The small model that ships inside the package, so that ``aiocb demo`` needs no download.

``pycode-tiny`` is a 4-layer Qwen3 (about 3.8M parameters, context 1024) with a 4096-token
byte-level BPE tokenizer, trained for a few CPU minutes by ``scripts/train_default_model.py``
on the Python standard library's own sources and on chat conversations made from them. It
writes plausible-looking Python; in a chat it follows the turn structure of its template
(ChatML with Hermes-style ``<tool_call>`` blocks, as Qwen2.5's) and ends its turns with
``<|im_end|>``, which its generation config stops at. It is there to show the runtime
working, not to be useful.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

#: The packaged Hugging Face model folder (config, generation config, weights, tokenizer).
DEFAULT_MODEL_PATH: Path = Path(__file__).resolve().parent / "assets" / "pycode-tiny"

#: Standard-library files the model never saw in training (paths relative to the stdlib
#: directory); the tests measure its loss on them. All exist in every Python >= 3.11.
HELD_OUT_FILES: tuple[str, ...] = ("textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py", "sched.py")

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def missing_files(path: Path = DEFAULT_MODEL_PATH) -> list[str]:
    """The files of a model folder that are not there (empty when it is complete)."""
    return [name for name in _REQUIRED_FILES if not (path / name).is_file()]


def load_default_model(
    device: str | torch.device = "cpu", dtype: torch.dtype | None = None, *, path: str | Path | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the packaged model and its tokenizer, offline.

    Args:
        device: where to put the model (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).
        dtype: the model's parameter dtype; ``None`` keeps the folder's float32 (the model
            is tiny, and bf16 matmuls are slower than fp32 ones on most CPUs).
        path: load another model folder instead (one that ``train_default_model.py
            --output`` wrote, say); ``None`` is :data:`DEFAULT_MODEL_PATH`.

    Returns:
        ``(model, tokenizer)``: a ``Qwen3ForCausalLM`` in eval mode on ``device`` and its
        ``PreTrainedTokenizerFast``.

    Raises:
        FileNotFoundError: the folder is incomplete (a source checkout where it was never
            built); the message says how to build it.
    """
    folder = DEFAULT_MODEL_PATH if path is None else Path(path)
    missing = missing_files(folder)
    if missing:
        how = (
            "build it with `python scripts/train_default_model.py` (a few minutes on a CPU, no download), "
            "or reinstall aiocb from a wheel, which ships it"
            if folder == DEFAULT_MODEL_PATH
            else f"write one with `python scripts/train_default_model.py --output {folder}`"
        )
        raise FileNotFoundError(f"the model folder {folder} lacks {', '.join(missing)}; {how}")
    # transformers draws a "Loading weights" progress bar; for a 46-tensor model it is noise.
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    model.to(device)  # type: ignore[arg-type]  # transformers types `.to` as if it took a model
    model.eval()  # type: ignore[no-untyped-call]
    return model, tokenizer
