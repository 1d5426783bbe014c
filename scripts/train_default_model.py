"""Train ``aiocb/assets/pycode-tiny``: the small model ``aiocb demo`` runs without a download.

The model learns Python from the one Python corpus every machine has: the standard
library's own ``.py`` sources (``sysconfig.get_paths()["stdlib"]``), test directories
and a few held-out files excepted. About a fifth of the tokens it trains on are chat
conversations made from that same code (see :func:`code_chat` and :func:`tool_chat`),
rendered with the ChatML / Hermes-tools template in ``chat_template.jinja``, so that it
also follows the turn structure of a chat (and of tool calls) and ends its turns with
``<|im_end|>``. It is a standard transformers Qwen3 with a byte-level BPE tokenizer from
the ``tokenizers`` library, saved as a normal Hugging Face folder::

    python scripts/train_default_model.py --threads 1   # 30 minutes (1,400 s of CPU) on a busy 2-core machine

On a machine busy with other work, ``--threads 1`` can be much faster: OpenMP threads
that wait for each other lose a lot when they do not each have a core.

The run is seeded; on the same machine and library versions it gives the same model
(bit for bit in our runs, with 1 or 2 threads). The stdlib differs between Python
versions, so the weights do too, but any version gives a model of about the same quality.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
import sysconfig
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from aiocb.default_model import DEFAULT_MODEL_PATH, HELD_OUT_FILES

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run as a script: its sibling module)
from copying_circuit import ROPE_THETA, copying_circuit, hold_circuit

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
#: Markup the model writes inside a turn. It is text the caller must see (a tool-call
#: parser reads it after decoding with ``skip_special_tokens=True``), so these are added
#: tokens that are not *special*, as in Qwen's tokenizer; ``EOS`` and the turn delimiters are.
TEXT_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
#: Every added token, in id order: ``EOS`` is 0, the BPE merges come after the last.
ADDED_TOKENS = (EOS, IM_START, IM_END, *TEXT_TOKENS)
CONTEXT = 1024
#: ChatML turns with Hermes-style tool calls (Qwen2.5's conventions), saved with the tokenizer.
CHAT_TEMPLATE = (Path(__file__).resolve().parent / "chat_template.jinja").read_text()

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


#: A chat as the template takes it: the messages, and the tool definitions (or ``None``).
Chat = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]

_JSON_TYPES = {"str": "string", "int": "integer", "bool": "boolean"}
#: Longest function source a coding answer quotes: the whole conversation should fit in a
#: training window, so that the model sees turns end far more often than it sees them cut.
_MAX_SOURCE_CHARS = 1200
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a Python expert. Answer with code.",
    "Be concise.",
    "You write Python for the standard library.",
)
_CODE_REQUESTS = (
    "Write a function `{signature}` that does this: {summary}",
    "Write a Python function `{signature}`. {Summary}",
    "Implement `{signature}`.\n{Summary}",
    "Write `{signature}`: {summary}",
)
_METHOD_REQUESTS = (
    "Write the method `{signature}` of class `{owner}`. {Summary}",
    "Implement `{owner}.{signature}`: {summary}",
)
_CALL_REQUESTS = (
    "Call {name} with {arguments}.",
    "Can you run `{name}` on {arguments}?",
    "{Summary} Use {arguments}.",
    "I need this: {summary} Arguments: {arguments}.",
)
_ANSWERS = ("`{name}` returned {result}.", "The result is {result}.", "Done: {name} gave {result}.")
_PARALLEL_ANSWERS = ("The results are {first} and {second}.", "`{name}` returned {first}, then {second}.")


@dataclass(frozen=True)
class Parameter:
    """One parameter of a function, typed for a JSON schema."""

    name: str
    type: str  # "string", "integer" or "boolean"
    required: bool


@dataclass(frozen=True)
class Function:
    """A documented public function or method of the stdlib, as ``ast`` reads it."""

    name: str
    owner: str | None  # the class of a method
    signature: str  # ``name(a, b=1)``, as written (``self`` included for methods)
    summary: str  # the docstring's first line: one sentence
    parameters: tuple[Parameter, ...]  # ``self``/``cls``, ``*args`` and ``**kwargs`` left out
    source: str | None  # dedented; ``None`` when too long to quote

    def tool(self) -> dict[str, Any]:
        """The function as an OpenAI-style tool definition."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.summary,
                "parameters": {
                    "type": "object",
                    "properties": {p.name: {"type": p.type} for p in self.parameters},
                    "required": [p.name for p in self.parameters if p.required],
                },
            },
        }


def _json_type(annotation: ast.expr | None, default: ast.expr | None) -> str:
    """A parameter's JSON type from its annotation or default; "string" when neither says."""
    if isinstance(annotation, ast.Name) and annotation.id in _JSON_TYPES:
        return _JSON_TYPES[annotation.id]
    if isinstance(default, ast.Constant):
        if isinstance(default.value, bool):  # before int: bool is an int
            return "boolean"
        if isinstance(default.value, int):
            return "integer"
    return "string"


def _parameters(args: ast.arguments, *, is_method: bool) -> tuple[Parameter, ...]:
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = list(zip(positional, defaults, strict=True)) + list(zip(args.kwonlyargs, args.kw_defaults, strict=True))
    if is_method and positional:
        pairs = pairs[1:]  # self or cls: not something a caller passes
    return tuple(Parameter(arg.arg, _json_type(arg.annotation, default), default is None) for arg, default in pairs)


def _function(node: ast.FunctionDef | ast.AsyncFunctionDef, text: str, owner: str | None) -> Function | None:
    """The :class:`Function` for a definition, or ``None`` if it is private or its docstring
    does not open with one short sentence (which the chats use as its description)."""
    docstring = ast.get_docstring(node)
    if node.name.startswith("_") or not docstring:
        return None
    summary = docstring.strip().splitlines()[0].strip()
    if not (12 <= len(summary) <= 100 and summary.endswith(".")):
        return None
    source = ast.get_source_segment(text, node, padded=True)
    if source is not None:
        source = textwrap.dedent(source)
    return Function(
        name=node.name,
        owner=owner,
        signature=f"{node.name}({ast.unparse(node.args)})",
        summary=summary,
        parameters=_parameters(node.args, is_method=owner is not None),
        source=source if source is not None and len(source) <= _MAX_SOURCE_CHARS else None,
    )


def stdlib_functions(texts: Sequence[str]) -> tuple[list[Function], list[str]]:
    """The documented module-level functions and methods of ``texts``, and the short string
    literals found there (the values tool calls pass), both in source order."""
    functions: list[Function] = []
    strings: dict[str, None] = {}  # a set that keeps the order, for reproducible sampling
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:  # a file for another grammar (lib2to3's test data, say)
            continue
        definitions: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str | None]] = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                definitions.append((node, None))
            elif isinstance(node, ast.ClassDef):
                definitions += [
                    (m, node.name) for m in node.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
        functions += [f for node, owner in definitions if (f := _function(node, text, owner)) is not None]
        for constant in ast.walk(tree):
            value = constant.value if isinstance(constant, ast.Constant) else None
            if (
                isinstance(value, str)
                and 2 <= len(value) <= 16
                and value.isascii()
                and value.isprintable()
                and value == value.strip()
            ):
                strings[value] = None
    return functions, list(strings)


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def _lowered(text: str) -> str:
    """``text`` with a lower-case first letter, unless it opens with a name (``HTTPError``)."""
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def _system(rng: random.Random) -> list[dict[str, Any]]:
    """A system message for some conversations, so that the model sees both forms."""
    return [{"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)}] if rng.random() < 0.3 else []


def code_chat(function: Function, rng: random.Random, tools: list[dict[str, Any]] | None = None) -> Chat:
    """The user asks for ``function`` (by signature and summary); the assistant writes its source."""
    assert function.source is not None
    requests = _METHOD_REQUESTS if function.owner else _CODE_REQUESTS
    request = rng.choice(requests).format(
        signature=function.signature,
        owner=function.owner,
        summary=_lowered(function.summary),
        Summary=_capitalized(function.summary),
    )
    messages = [
        *_system(rng),
        {"role": "user", "content": request},
        {"role": "assistant", "content": function.source.rstrip()},
    ]
    return messages, tools


def _value(kind: str, rng: random.Random, strings: Sequence[str]) -> Any:
    """A random argument or result of a JSON type."""
    if kind == "integer":
        return rng.randint(0, 100)
    if kind == "boolean":
        return rng.random() < 0.5
    return rng.choice(strings)


def _arguments(function: Function, rng: random.Random, strings: Sequence[str]) -> dict[str, Any]:
    """Values for the required parameters and for some optional ones."""
    return {p.name: _value(p.type, rng, strings) for p in function.parameters if p.required or rng.random() < 0.3}


def _result(rng: random.Random, strings: Sequence[str]) -> str:
    """What a tool sends back: some JSON value."""
    kind = rng.choice(("string", "integer", "boolean", "list"))
    value = [rng.choice(strings) for _ in range(rng.randint(1, 3))] if kind == "list" else _value(kind, rng, strings)
    return json.dumps(value)


def tool_chat(functions: Sequence[Function], rng: random.Random, strings: Sequence[str]) -> Chat:
    """One tool-calling exchange: ``functions`` are the tools, the user asks for one of them
    with some arguments, the assistant calls it (once, or sometimes twice in parallel), the
    tool answers, and the assistant reports the result."""
    target = rng.choice(functions)
    calls = 2 if rng.random() < 0.2 else 1
    arguments = [_arguments(target, rng, strings) for _ in range(calls)]
    shown = " and ".join(", ".join(f"{k}={json.dumps(v)}" for k, v in a.items()) or "no arguments" for a in arguments)
    request = rng.choice(_CALL_REQUESTS).format(
        name=target.name, arguments=shown, summary=_lowered(target.summary), Summary=_capitalized(target.summary)
    )
    results = [_result(rng, strings) for _ in range(calls)]
    if calls == 1:
        answer = rng.choice(_ANSWERS).format(name=target.name, result=results[0])
    else:
        answer = rng.choice(_PARALLEL_ANSWERS).format(name=target.name, first=results[0], second=results[1])
    tool_calls = [{"type": "function", "function": {"name": target.name, "arguments": a}} for a in arguments]
    messages = [
        *_system(rng),
        {"role": "user", "content": request},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        *({"role": "tool", "content": result} for result in results),
        {"role": "assistant", "content": answer},
    ]
    return messages, [f.tool() for f in functions]


def random_chat(functions: Sequence[Function], strings: Sequence[str], rng: random.Random) -> Chat:
    """A coding request or a tool call, half and half. Some coding requests come with tools
    offered, so that the model also sees tools that are not needed go unused."""
    coders = [f for f in functions if f.source is not None]
    callables = [f for f in functions if 1 <= len(f.parameters) <= 4]
    if rng.random() < 0.5:
        offered = [f.tool() for f in rng.sample(callables, rng.randint(1, 3))] if rng.random() < 0.15 else None
        return code_chat(rng.choice(coders), rng, offered)
    return tool_chat(rng.sample(callables, rng.randint(1, 3)), rng, strings)


def render_chats(tokenizer: PreTrainedTokenizerFast, chats: Sequence[Chat]) -> list[str]:
    """Conversations as training text, through the very template the model is saved with."""
    texts: list[str] = []
    for messages, tools in chats:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        assert isinstance(text, str)
        texts.append(text)
    return texts


def chat_documents(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str], tokens: int, seed: int) -> list[list[int]]:
    """Random chats about the functions of ``texts``, encoded as by :func:`encode_documents`,
    until they hold at least ``tokens`` tokens."""
    functions, strings = stdlib_functions(texts)
    rng = random.Random(seed)
    documents: list[list[int]] = []
    while sum(map(len, documents)) < tokens:
        chats = [random_chat(functions, strings, rng) for _ in range(64)]
        documents += encode_documents(tokenizer.backend_tokenizer, render_chats(tokenizer, chats))
    return documents


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style: any byte string encodes, nothing is <unk>)
    whose first ids are :data:`ADDED_TOKENS`, each one token wherever it appears."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,  # the added tokens included
        min_frequency=2,
        special_tokens=list(ADDED_TOKENS),  # ids 0, 1, ...
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # The trainer makes all of them special (dropped by skip_special_tokens); the markup the
    # caller must read is not. Edited in the serialized form: `add_tokens` would show the
    # new flag but leave the decoder's set of special ids as it was.
    saved = json.loads(tokenizer.to_str())
    for added in saved["added_tokens"]:
        added["special"] = added["content"] not in TEXT_TOKENS
    return Tokenizer.from_str(json.dumps(saved))


def chat_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """``tokenizer`` as transformers sees it, with the chat template and the turn delimiters
    registered as special tokens (as Qwen's are)."""
    # No model_max_length: transformers would warn on every long text encoded (a whole file
    # to score, say); the context length is in config.json (max_position_embeddings).
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        pad_token=EOS,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
    )


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Each text's token ids, followed by EOS."""
    eos = tokenizer.token_to_id(EOS)
    return [[*encoding.ids, eos] for encoding in tokenizer.encode_batch(list(texts))]


def token_stream(documents: Sequence[Sequence[int]]) -> torch.Tensor:
    """The documents one after the other, as one tensor."""
    return torch.tensor([token for document in documents for token in document], dtype=torch.long)


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
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},  # (the copying circuit's)
        tie_word_embeddings=True,  # the embedding is a quarter of the model; don't store it twice
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def generation_config(eos_id: int, im_end_id: int) -> GenerationConfig:
    """Demo defaults. Greedy decoding of a model this small loops on one line forever;
    mild sampling with a nucleus cut-off reads much more like real code. Generation stops
    at the end of a document or of a chat turn."""
    return GenerationConfig(
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        top_k=50,
        max_new_tokens=64,
        eos_token_id=[eos_id, im_end_id],
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


def chat_prompts(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str], count: int, seed: int) -> list[str]:
    """``count`` random chats about the functions of ``texts``, cut after the first user
    turn and rendered with the generation prompt: what the model should answer."""
    functions, strings = stdlib_functions(texts)
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        messages, tools = random_chat(functions, strings, rng)
        first_user = next(i for i, message in enumerate(messages) if message["role"] == "user")
        text = tokenizer.apply_chat_template(
            messages[: first_user + 1], tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert isinstance(text, str)
        prompts.append(text)
    return prompts


@torch.no_grad()
def chat_answers(
    model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: Sequence[str], *, seed: int
) -> list[tuple[str, bool]]:
    """Each prompt's sampled answer (special tokens kept), and whether it ended its turn
    with ``<|im_end|>`` within 300 tokens."""
    model.eval()
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    answers = []
    for i, prompt in enumerate(prompts):
        torch.manual_seed(seed + i)
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=300)[0, ids.shape[1] :]
        answers.append((tokenizer.decode(out.tolist()), int(out[-1]) == im_end))
    model.train()
    return answers


def save(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, output: Path) -> None:
    """Write a Hugging Face model folder: config, generation config, weights, tokenizer
    (with its chat template)."""
    output.mkdir(parents=True, exist_ok=True)
    # Weights are stored in bf16 to halve the folder that ships in the package (and in git),
    # but the config asks for float32: `from_pretrained` then upcasts on load, because bf16
    # matmuls on most CPUs are much slower than fp32 ones and the model is tiny anyway.
    model.to(torch.bfloat16).save_pretrained(output)
    model.to(torch.float32)
    config_path = output / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(output)


def write_model_card(output: Path, **facts: float) -> None:
    """A README for the folder: what the model is, how it was made, what it is (not) for."""
    ids = ", ".join(f"`{token}` {i}" for i, token in enumerate(ADDED_TOKENS))
    card = f"""# pycode-tiny

The model `aiocb demo` runs: a {facts["parameters"] / 1e6:.1f}M-parameter Qwen3 (4 layers, width 256,
context {CONTEXT}) with a {facts["vocab"]:.0f}-token byte-level BPE tokenizer, trained from scratch by
`scripts/train_default_model.py` on the `.py` sources of the Python {sys.version.split()[0]} standard
library ({facts["files"]:.0f} files, {facts["tokens"] / 1e6:.2f}M tokens; tests and the files in
`aiocb.default_model.HELD_OUT_FILES` left out) and on {facts["chats"]:.0f} chat conversations made from
that code ({facts["chat_tokens"] / 1e6:.2f}M tokens, {100 * facts["chat_share"]:.0f}% of the training stream).

- {facts["steps"]:.0f} AdamW steps, {facts["tokens_seen"] / 1e6:.1f}M tokens seen, seed {facts["seed"]:.0f},
  {facts["minutes"]:.1f} minutes of wall-clock time with {facts["threads"]:.0f} torch thread(s)
- final training loss {facts["train_loss"]:.2f}, held-out loss {facts["held_out_loss"]:.2f} on code and
  {facts["chat_loss"]:.2f} on chats about held-out code (nats per token)
- {facts["chat_ends"]:.0f} of {facts["chat_prompts"]:.0f} sampled chat answers end their turn with `<|im_end|>`
  within 300 tokens
- weights stored in bfloat16 to keep the package small; `config.json` asks for float32 on load
- a copying circuit (a previous-token head and an induction head in its first two layers,
  `scripts/copying_circuit.py`) written into its weights before training and held there, so
  that it repeats what its context holds (prompt-lookup speculation gains from that); a model
  this small trained this briefly does not learn one

## Chat

The tokenizer carries a ChatML chat template with Hermes-style tool calls, the conventions of
Qwen2.5: each message is `<|im_start|>{{role}}\\n{{content}}<|im_end|>\\n`; tool definitions
(`tools=`) go into the system message; an assistant calls a tool with
`<tool_call>\\n{{"name": ..., "arguments": {{...}}}}\\n</tool_call>`; tool results come back in a
user turn as `<tool_response>\\n...\\n</tool_response>`. `generation_config.json` stops at
`<|endoftext|>` and at `<|im_end|>`.

Added tokens, one id each:
{ids}.
The first three are special (`skip_special_tokens=True` drops them); the tool and think markup
is not, so that it stays in decoded text.

The coding conversations ask for a stdlib function by signature and docstring summary and
get its source back; the tool conversations offer stdlib functions as tools (parameters typed
string, integer or boolean), call one with made-up arguments and report a made-up result.

It writes text that looks like Python and means nothing, and its chat answers follow the form
of a conversation, not its sense: it exists to show the runtime working without a download.
Rebuild it with `python scripts/train_default_model.py`.
"""
    (output / "README.md").write_text(card)


def main(argv: Sequence[str] | None = None) -> int:
    """Train and save the model; prints the loss as it goes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_MODEL_PATH)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=2)
    # Lower than the 2e-3 that suited 8 windows of 256 tokens: 2 windows of 1024 are a
    # noisier gradient (1.2e-3 ended 0.15 nats lower on held-out code, 3e-3 was worse).
    parser.add_argument("--lr", type=float, default=1.2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--chat-share", type=float, default=0.2, help="fraction of the training tokens that are chats")
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
    chat_tok = chat_tokenizer(tokenizer)
    code = encode_documents(tokenizer, texts)
    code_tokens = sum(map(len, code))
    chats = chat_documents(chat_tok, texts, round(code_tokens * args.chat_share / (1 - args.chat_share)), args.seed)
    chat_tokens = sum(map(len, chats))
    # Shuffled so that the random training windows meet chats all through the stream, not
    # in one stretch of it.
    documents = code + chats
    random.Random(args.seed).shuffle(documents)
    data = token_stream(documents)
    eval_data = token_stream(encode_documents(tokenizer, held_out))
    eval_chats = token_stream(chat_documents(chat_tok, held_out, 8 * CONTEXT, args.seed))
    print(
        f"tokenizer: {tokenizer.get_vocab_size()} tokens; code {code_tokens / 1e6:.2f}M tokens "
        f"({sum(map(len, texts)) / code_tokens:.2f} characters/token), {len(chats)} chats {chat_tokens / 1e6:.2f}M "
        f"tokens ({chat_tokens / data.numel():.0%}); held out {eval_data.numel()} code and {eval_chats.numel()} "
        f"chat tokens [{time.perf_counter() - started:.0f}s]",
        flush=True,
    )

    eos_id = tokenizer.token_to_id(EOS)
    model = Qwen3ForCausalLM(model_config(tokenizer.get_vocab_size(), eos_id))
    model.generation_config = generation_config(eos_id, tokenizer.token_to_id(IM_END))
    circuit = copying_circuit(model.config, args.seed)
    hold_circuit(model, circuit)
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
        hold_circuit(model, circuit)
        value = loss.detach().item()
        smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
        if step % 20 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - started
            print(f"step {step:5d}  loss {value:.3f}  (avg {smoothed:.3f})  [{elapsed:.0f}s]", flush=True)
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            print(
                f"  held-out loss {mean_loss(model, eval_data):.3f}, chats {mean_loss(model, eval_chats):.3f}",
                flush=True,
            )

    held_out_loss = mean_loss(model, eval_data)
    chat_loss = mean_loss(model, eval_chats)
    print(f"  held-out loss {held_out_loss:.3f}, chats {chat_loss:.3f}", flush=True)
    for prompt in ("def ", "import os\n", "class Config:\n    def __init__(self"):
        for greedy in (True, False):
            text = sample(model, tokenizer, prompt, greedy=greedy, seed=args.seed)
            print(f"--- {'greedy' if greedy else 'sampled'}: {prompt!r}\n{text}", flush=True)
    prompts = chat_prompts(chat_tok, held_out, 8, args.seed)
    answers = chat_answers(model, chat_tok, prompts, seed=args.seed)
    for prompt, (answer, ended) in zip(prompts, answers, strict=True):
        print(f"--- chat ({'ended' if ended else 'cut off'}):\n{prompt.split(IM_START)[-2]}{answer}", flush=True)
    chat_ends = sum(ended for _, ended in answers)
    print(f"  {chat_ends} of {len(answers)} chat answers ended with {IM_END}", flush=True)
    save(model, chat_tok, args.output)
    wall, cpu = time.perf_counter() - started, time.process_time()
    write_model_card(
        args.output,
        parameters=sum(p.numel() for p in model.parameters()),
        vocab=tokenizer.get_vocab_size(),
        files=len(texts),
        tokens=code_tokens,
        chats=len(chats),
        chat_tokens=chat_tokens,
        chat_share=chat_tokens / data.numel(),
        steps=args.steps,
        tokens_seen=args.steps * args.batch_size * CONTEXT,
        train_loss=smoothed or float("nan"),
        held_out_loss=held_out_loss,
        chat_loss=chat_loss,
        chat_ends=chat_ends,
        chat_prompts=len(answers),
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
