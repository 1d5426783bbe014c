"""Server fixtures: a local byte-level BPE tokenizer, a tiny model with its vocabulary, and
the app over ASGI (httpx) or a real uvicorn server on 127.0.0.1 (port 0), all on the
test's event loop."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

import aiocb
from aiocb.server import build_app
from aiocb.server.connections import h11_protocol
from aiocb.server.limits import ServerLimits
from tests.conftest import tiny_qwen3

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the CLI test forks after tokenizing
MODEL_NAME = "tiny-qwen3"
API_KEY = "sk-test-key"
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: A few KB of varied text, multi-byte characters included, to train the tokenizer on.
CORPUS = """
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Once upon a time, in a small village by the sea, there lived an old fisherman and his cat.
Every morning he rowed out before dawn; every evening he came back with stories to tell.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -7 +12 1e9 0x1F.
Punctuation and symbols: ( ) [ ] { } < > ; : , . ! ? ' " - _ = + * / \\ | @ # $ % ^ & ~ `
Question: What is the capital of France? Answer: Paris.
Question: How many legs does a spider have? Answer: eight.
Question: Which planet is known as the red planet? Answer: Mars.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
Héllo wörld, naïve café, façade, jalapeño, Ångström, smörgåsbord, crème brûlée.
Привет, мир! Как дела? Всё хорошо, спасибо.
你好，世界！今天天气很好。我们去公园散步吧。
こんにちは世界。ありがとうございます。
안녕하세요 세계. 감사합니다.
Emoji: 😀 🚀 🌍 ✨ 👍🏽 ❤️ 🇫🇷
Mathematics: ∑ ∫ √ ∞ ≤ ≥ ≠ ≈ π θ λ μ Ω.
The model reads tokens and writes tokens; the server streams them to many clients at once.
A continuous batching engine schedules requests, computes their keys and values, and frees blocks.
""".strip()


def build_tokenizer(vocab_size: int = 640) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on :data:`CORPUS`, with an EOS and a chat template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([CORPUS] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=EOS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_byte_fallback_tokenizer(vocab_size: int = 400, *, bos: bool = False) -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama 2, Mistral, Gemma): BPE over "▁"-joined words
    trained on :data:`CORPUS`, every byte a token of its own (``<0xE4>``) for characters
    outside its vocabulary, and a decoder that fuses byte runs into characters (U+FFFD
    where a run is not UTF-8) and strips the text's leading space; with ``bos``, encoding a
    text puts ``<s>`` before it."""
    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False, limit_alphabet=60
    )
    backend.train_from_iterator([CORPUS] * 4, trainer)
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # (in the model's vocabulary, where byte fallback looks)
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    backend = Tokenizer.from_str(json.dumps(spec))
    if bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    return tokenizer


class DecodeOnly:
    """A tokenizer without the tokenizers library's backend (a slow tokenizer's shape:
    ``decode``, and the token lookups the detokenizer asks of one): the incremental
    detokenizer's window method."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        # (the tokens its decode skips: the backend's special added tokens)
        added = tokenizer.backend_tokenizer.get_added_tokens_decoder()
        self.all_special_ids = [i for i, token in added.items() if token.special]
        self.unk_token_id = tokenizer.unk_token_id
        self.clean_up_tokenization_spaces = tokenizer.clean_up_tokenization_spaces

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **options: Any) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, **options)
        return text

    def convert_tokens_to_ids(self, token: str) -> Any:
        return self._tokenizer.convert_tokens_to_ids(token)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def serve_model(tokenizer: Any, seed: int = 0, **config: Any) -> PreTrainedModel:
    """A tiny Qwen3 whose vocabulary is the tokenizer's and whose EOS is the tokenizer's
    (``config`` changes other fields of its configuration)."""
    model = tiny_qwen3(seed, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@pytest.fixture(scope="session")
def model(tokenizer: Any) -> PreTrainedModel:
    return serve_model(tokenizer)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, model: PreTrainedModel, tokenizer: Any) -> Path:
    """The model and its tokenizer saved together, as ``aiocb serve PATH`` loads them."""
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def serve_config(**changes: Any) -> aiocb.ContinuousBatchingConfig:
    """A small, fixed cache (no sizing from host memory)."""
    return aiocb.ContinuousBatchingConfig(**{"page_size": 16, "num_blocks": 512, **changes})


@pytest.fixture
async def manager(model: PreTrainedModel) -> AsyncIterator[aiocb.Manager]:
    async with aiocb.Manager(model, continuous_batching_config=serve_config()) as running:
        yield running


@pytest.fixture
async def client(manager: aiocb.Manager, tokenizer: Any) -> AsyncIterator[httpx.AsyncClient]:
    """httpx over the ASGI app (no socket); the manager already runs on the test's loop."""
    app = build_app(manager, tokenizer, MODEL_NAME)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        yield http


@dataclass(frozen=True)
class LiveServer:
    """A uvicorn server running in the test's event loop."""

    manager: aiocb.Manager
    port: int
    #: uvicorn's open connections (its protocols)
    connections: set[Any]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def until_connections(self, done: Callable[[int], bool], within_s: float = 10.0) -> None:
        """Wait until ``done(the number of open connections)``, for ``within_s`` at most."""
        for _ in range(int(within_s / 0.01)):
            if done(len(self.connections)):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{len(self.connections)} connections still open after {within_s} s")


@asynccontextmanager
async def live_server(
    manager: aiocb.Manager,
    tokenizer: Any,
    api_key: str | None = None,
    *,
    limits: ServerLimits | None = None,
    header_timeout: float = 30.0,
    max_header_bytes: int = 16384,
    max_connections: int | None = None,
    protocol: Callable[..., type[asyncio.Protocol]] = h11_protocol,
) -> AsyncIterator[LiveServer]:
    """uvicorn on 127.0.0.1 with a free port, as a task of the running loop, with the
    protocol ``aiocb serve`` gives it; stopped on exit."""
    import uvicorn

    limits = limits or ServerLimits()
    app = build_app(manager, tokenizer, MODEL_NAME, api_key=api_key, limits=limits)
    http = protocol(
        header_timeout,
        max_header_bytes,
        max_connections=max_connections,
        send_timeout=limits.send_timeout,
        metrics=app.state.aiocb.metrics,
    )
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=http,
        lifespan="on",
        log_config=None,
        log_level="warning",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(30):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("uvicorn exited before it started")
                await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield LiveServer(manager, port, server.server_state.connections)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


@pytest.fixture
async def server(manager: aiocb.Manager, tokenizer: Any) -> AsyncIterator[LiveServer]:
    async with live_server(manager, tokenizer, api_key=API_KEY) as running:
        yield running


async def wait_until_idle(manager: aiocb.Manager, within_s: float = 2.0) -> aiocb.ManagerStatistics:
    """Wait until nothing runs or waits and every block is free; the last statistics."""
    stats = manager.statistics()
    for _ in range(int(within_s / 0.005)):
        if stats.running_requests == 0 and stats.waiting_requests == 0 and stats.free_blocks == stats.total_blocks:
            break
        await asyncio.sleep(0.005)
        stats = manager.statistics()
    return stats


async def wait_until_running(manager: aiocb.Manager, count: int, within_s: float = 10.0) -> None:
    """Wait until ``count`` requests are in the running batch."""
    for _ in range(int(within_s / 0.005)):
        if manager.statistics().running_requests >= count:
            return
        await asyncio.sleep(0.005)
    raise TimeoutError(f"{count} requests were not running after {within_s} s")
