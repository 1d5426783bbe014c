"""Train ``aiocb/assets/pycode-tiny``: the small model ``aiocb demo`` runs without a download.

The model learns Python from the one Python corpus every machine has: the standard
library's own ``.py`` sources (``sysconfig.get_paths()["stdlib"]``), test directories
and a few held-out files excepted. It is a standard transformers Qwen3 with a byte-level
BPE tokenizer from the ``tokenizers`` library, saved as a normal Hugging Face folder::

    python scripts/train_default_model.py            # about 7.5 minutes on 2 idle CPU cores

On a machine busy with other work, ``--threads 1`` can be much faster: OpenMP threads
that wait for each other lose a lot when they do not each have a core.

The run is seeded; on the same machine and library versions it gives the same model
(bit for bit in our runs, with 1 or 2 threads). The stdlib differs between Python
versions, so the weights do too, but any version gives a model of about the same quality.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from aiocb.default_model import DEFAULT_MODEL_PATH, HELD_OUT_FILES

EOS = "<|endoftext|>"
CONTEXT = 256

#: Directories whose files are not ordinary Python: tests, generated codec tables, pydoc's
#: documentation dump, and third-party packages installed into the interpreter.
_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}
)
#: Single files that are mostly data tables.
_EXCLUDED_FILES = frozenset({"html/entities.py", "unicodedata.py"})


def stdlib_root() -> Path:
    """The directory holding the standard library's ``.py`` sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def training_files(root: Path) -> list[Path]:
    """The stdlib files to train on, sorted so that the corpus order is reproducible."""
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.as_posix() in _EXCLUDED_FILES:
            continue
        if rel.as_posix() in HELD_OUT_FILES:
            continue
        files.append(path)
    return files


def read_sources(files: Sequence[Path]) -> list[str]:
    """File contents; undecodable or empty files are skipped."""
    texts = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            texts.append(text)
    return texts


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style: any byte string encodes, nothing is <unk>)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode_corpus(tokenizer: Tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """All files as one token stream, each file followed by EOS."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts)):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def model_config(vocab_size: int, eos_id: int) -> Qwen3Config:
    """The architecture: about 3.8M parameters, most of them in 4 layers of width 256."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,  # the embedding is a quarter of the model; don't store it twice
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def generation_config(eos_id: int) -> GenerationConfig:
    """Demo defaults. Greedy decoding of a model this small loops on one line forever;
    mild sampling with a nucleus cut-off reads much more like real code."""
    return GenerationConfig(
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        top_k=50,
        max_new_tokens=64,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def batches(data: torch.Tensor, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless batches of random ``CONTEXT``-token windows of ``data``."""
    while True:
        starts = torch.randint(0, data.numel() - CONTEXT, (batch_size,), generator=generator)
        yield torch.stack([data[s : s + CONTEXT] for s in starts.tolist()])


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then a cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def mean_loss(model: Qwen3ForCausalLM, data: torch.Tensor, max_windows: int = 16) -> float:
    """Mean next-token loss over up to ``max_windows`` consecutive windows of ``data``."""
    model.eval()
    windows = [data[i : i + CONTEXT] for i in range(0, data.numel() - CONTEXT + 1, CONTEXT)][:max_windows]
    batch = torch.stack(windows)
    loss = model(input_ids=batch, labels=batch).loss  # the model shifts the labels itself
    model.train()
    return float(loss)


@torch.no_grad()
def sample(model: Qwen3ForCausalLM, tokenizer: Tokenizer, prompt: str, *, greedy: bool, seed: int = 0) -> str:
    """A continuation of ``prompt``: greedy, or sampled with the demo's generation config."""
    model.eval()
    torch.manual_seed(seed)
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    greedy_args = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None} if greedy else {}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, **greedy_args)
    model.train()
    return tokenizer.decode(out[0].tolist(), skip_special_tokens=True)


def save(model: Qwen3ForCausalLM, tokenizer: Tokenizer, output: Path) -> None:
    """Write a Hugging Face model folder: config, generation config, weights, tokenizer."""
    output.mkdir(parents=True, exist_ok=True)
    eos_id = tokenizer.token_to_id(EOS)
    # Weights are stored in bf16 to halve the folder that ships in the package (and in git),
    # but the config asks for float32: `from_pretrained` then upcasts on load, because bf16
    # matmuls on most CPUs are much slower than fp32 ones and the model is tiny anyway.
    model.to(torch.bfloat16).save_pretrained(output)
    model.to(torch.float32)
    config_path = output / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation_config(eos_id).save_pretrained(output)
    # No model_max_length: transformers would warn on every long text encoded (a whole file
    # to score, say); the context length is in config.json (max_position_embeddings).
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(output)


def write_model_card(output: Path, **facts: float) -> None:
    """A README for the folder: what the model is, how it was made, what it is (not) for."""
    card = f"""# pycode-tiny

The model `aiocb demo` runs: a {facts["parameters"] / 1e6:.1f}M-parameter Qwen3 (4 layers, width 256,
context {CONTEXT}) with a {facts["vocab"]:.0f}-token byte-level BPE tokenizer, trained from scratch by
`scripts/train_default_model.py` on the `.py` sources of the Python {sys.version.split()[0]} standard
library ({facts["files"]:.0f} files, {facts["tokens"] / 1e6:.2f}M tokens; tests and the files in
`aiocb.default_model.HELD_OUT_FILES` left out).

- {facts["steps"]:.0f} AdamW steps, {facts["tokens_seen"] / 1e6:.1f}M tokens seen, seed {facts["seed"]:.0f},
  {facts["minutes"]:.1f} minutes of wall-clock time with {facts["threads"]:.0f} torch thread(s)
- final training loss {facts["train_loss"]:.2f}, held-out loss {facts["held_out_loss"]:.2f} (nats per token)
- weights stored in bfloat16 to keep the package small; `config.json` asks for float32 on load

It writes text that looks like Python and means nothing: it exists to show the runtime working
without a download. Rebuild it with `python scripts/train_default_model.py`.
"""
    (output / "README.md").write_text(card)


def main(argv: Sequence[str] | None = None) -> int:
    """Train and save the model; prints the loss as it goes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_MODEL_PATH)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=100)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    started = time.perf_counter()

    root = stdlib_root()
    files = training_files(root)
    texts = read_sources(files)
    held_out = read_sources([root / name for name in HELD_OUT_FILES if (root / name).exists()])
    print(f"corpus: {len(texts)} files, {sum(map(len, texts)) / 1e6:.1f}M characters from {root}", flush=True)

    tokenizer = train_tokenizer(texts, args.vocab_size)
    data = encode_corpus(tokenizer, texts)
    eval_data = encode_corpus(tokenizer, held_out)
    print(
        f"tokenizer: {tokenizer.get_vocab_size()} tokens; corpus {data.numel() / 1e6:.2f}M tokens "
        f"({sum(map(len, texts)) / data.numel():.2f} characters/token), held out {eval_data.numel()} tokens "
        f"[{time.perf_counter() - started:.0f}s]",
        flush=True,
    )

    eos_id = tokenizer.token_to_id(EOS)
    model = Qwen3ForCausalLM(model_config(tokenizer.get_vocab_size(), eos_id))
    model.generation_config = generation_config(eos_id)
    model.train()
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "embed" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(args.seed)
    stream = batches(data, args.batch_size, generator)
    smoothed = None
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        batch = next(stream)
        loss = model(input_ids=batch, labels=batch).loss  # the model shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().item()
        smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
        if step % 20 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - started
            print(f"step {step:5d}  loss {value:.3f}  (avg {smoothed:.3f})  [{elapsed:.0f}s]", flush=True)
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            print(f"  held-out loss {mean_loss(model, eval_data):.3f}", flush=True)

    held_out_loss = mean_loss(model, eval_data)
    print(f"  held-out loss {held_out_loss:.3f}", flush=True)
    for prompt in ("def ", "import os\n", "class Config:\n    def __init__(self"):
        for greedy in (True, False):
            text = sample(model, tokenizer, prompt, greedy=greedy, seed=args.seed)
            print(f"--- {'greedy' if greedy else 'sampled'}: {prompt!r}\n{text}", flush=True)
    save(model, tokenizer, args.output)
    wall, cpu = time.perf_counter() - started, time.process_time()
    write_model_card(
        args.output,
        parameters=sum(p.numel() for p in model.parameters()),
        vocab=tokenizer.get_vocab_size(),
        files=len(texts),
        tokens=data.numel(),
        steps=args.steps,
        tokens_seen=args.steps * args.batch_size * CONTEXT,
        train_loss=smoothed or float("nan"),
        held_out_loss=held_out_loss,
        minutes=wall / 60,
        seed=args.seed,
        threads=args.threads,
    )
    size = sum(f.stat().st_size for f in args.output.iterdir())
    print(
        f"saved {args.output} ({size / 1e6:.2f} MB); held-out loss {held_out_loss:.3f}; "
        f"{wall:.0f}s wall, {cpu:.0f}s CPU",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
