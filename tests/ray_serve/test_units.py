"""aiocb.ray_serve's parts that need no Ray cluster: prefix hashing, the router's policy,
the in-process ASGI forwarding (cancellation included) and build_app's checks."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.request_router import PendingRequest
from transformers import PreTrainedModel

import aiocb
from aiocb.errors import InvalidConfigError
from aiocb.ray_serve import BLOCK_CHARS, PrefixAffinityRouter, build_app, prefix_hashes, prompt_text
from aiocb.ray_serve.forwarding import ForwardedRequest, ResponseStart, run_asgi
from aiocb.server import build_app as build_server
from aiocb.server.limits import ServerLimits
from tests.server.conftest import MODEL_NAME, serve_config, wait_until_idle, wait_until_running

# ------------------------------------------------------------------ prefix hashing


def test_prefix_hashes_chain_full_blocks_so_shared_prefixes_share_leading_hashes() -> None:
    system = "s" * (3 * BLOCK_CHARS)
    a = prefix_hashes(system + "user one asks " * 40)
    b = prefix_hashes(system + "user two asks " * 40)
    assert len(a) == len(system + "user one asks " * 40) // BLOCK_CHARS
    assert a[:3] == b[:3], "the system prompt's three blocks hash the same"
    assert a[3] != b[3]
    assert prefix_hashes("x" * (BLOCK_CHARS - 1)) == (), "only full blocks are hashed"
    # Chained: the same block after different prefixes hashes differently.
    after_a, after_b = ("a" * BLOCK_CHARS + "c" * BLOCK_CHARS), ("b" * BLOCK_CHARS + "c" * BLOCK_CHARS)
    assert prefix_hashes(after_a)[1] != prefix_hashes(after_b)[1]
    assert len(prefix_hashes("z" * (BLOCK_CHARS * 1000))) == 256, "bounded work per prompt"


def test_prompt_text_reads_completions_and_chat_prompts() -> None:
    assert prompt_text("/v1/completions", {"prompt": "hello"}) == "hello"
    assert prompt_text("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert prompt_text("/v1/completions", {"prompt": [1, 2, 3]}) == "1,2,3"
    assert prompt_text("/v1/completions", {"prompt": [[4, 5], [6]]}) == "4,5"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = prompt_text("/v1/chat/completions", {"messages": chat})
    assert text is not None and text.startswith("\x1esystem\x1fbe brief")
    longer = prompt_text("/v1/chat/completions", {"messages": [*chat, {"role": "assistant", "content": "yo"}]})
    assert longer is not None and longer.startswith(text), "a conversation's prefix is its earlier turns"
    assert prompt_text("/v1/chat/completions", {"messages": "not a list"}) is None
    assert prompt_text("/v1/models", {"prompt": "x"}) is None
    assert prompt_text("/v1/completions", ["not", "an", "object"]) is None


def test_prompt_text_reads_no_more_of_a_prompt_than_is_hashed() -> None:
    """A body of megabytes is made text only as far as its hashed blocks go (made whole,
    2.7 million ids held the ingress's loop a third of a second): a longer prompt with the
    same beginning hashes the same."""
    limit = BLOCK_CHARS * 256
    for path, key, long, short in (
        ("/v1/completions", "prompt", "x" * 3_000_000, "x" * 100_000),
        ("/v1/completions", "prompt", [7] * 3_000_000, [7] * 100_000),
        ("/v1/chat/completions", "messages", [{"role": "user", "content": [{"type": "text", "text": "a"}] * 300_000}],
         [{"role": "user", "content": [{"type": "text", "text": "a"}] * 20_000}]),
        ("/v1/chat/completions", "messages", [{"role": "u", "content": "x", "name": str(i)} for i in range(200_000)],
         [{"role": "u", "content": "x", "name": str(i)} for i in range(10_000)]),
        # (a long role is not written out whole either)
        ("/v1/chat/completions", "messages", [{"role": "r" * 3_000_000, "content": "x"}],
         [{"role": "r" * 100_000, "content": "x"}]),
    ):  # fmt: skip
        text = prompt_text(path, {key: long})
        assert text is not None and len(text) < 2 * limit, (path, len(text or ""))
        assert prefix_hashes(text) == prefix_hashes(prompt_text(path, {key: short}) or "")
        assert len(prefix_hashes(text)) == 256
    # Nor is one that is no string (an id list of megabytes, written whole, held the loop 180 ms).
    text = prompt_text("/v1/chat/completions", {"messages": [{"role": list(range(3_000_000)), "content": "x"}]})
    assert text is not None and len(text) < 2 * limit
    short = prompt_text("/v1/chat/completions", {"messages": [{"role": list(range(100_000)), "content": "x"}]})
    assert prefix_hashes(text) == prefix_hashes(short or "")


# ------------------------------------------------------------------ the router's policy


class _FakeReplica:
    """What the router reads of a replica."""

    def __init__(self, unique_id: str) -> None:
        self.replica_id = ReplicaID(unique_id, DeploymentID("AiocbEngine", "aiocb"))
        self.max_ongoing_requests = 512


def _router(max_imbalance: int = 4) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(DeploymentID("AiocbEngine", "aiocb"), DeploymentHandleSource.REPLICA)
    router.initialize_state(max_imbalance=max_imbalance, max_entries=1000)
    return router


def _pending(prefix: tuple[int, ...], request_id: str = "r") -> PendingRequest:
    request = ForwardedRequest("POST", "/v1/completions", b"", (), b"", prefix=prefix)
    return PendingRequest(args=[request], kwargs={}, metadata=SimpleNamespace(internal_request_id=request_id))  # type: ignore[arg-type]


async def test_the_router_follows_a_known_prefix_unless_its_replica_is_much_busier() -> None:
    router = _router(max_imbalance=4)
    a, b, c = _FakeReplica("a"), _FakeReplica("b"), _FakeReplica("c")
    replicas: list[Any] = [a, b, c]
    short = await router.choose_replicas(replicas, _pending(()))
    assert len(short[0]) == 2 and sum(len(rank) for rank in short) == 3, "no full block: two random, then the rest"
    first = await router.choose_replicas(replicas, _pending((1, 2, 3)))
    assert len(first[0]) == 1 and sum(len(rank) for rank in first) == 3, "a new prefix: the emptiest cache first"
    router.on_request_routed(_pending((1, 2, 3)), b.replica_id, None)
    assert (await router.choose_replicas(replicas, _pending((50, 51))))[0] != [b], "b holds blocks, a and c none"

    # A request sharing the first two blocks goes to b; one sharing none does not have to.
    for _ in range(3):  # the prefix's replica alone, for a few attempts (its probe may be slow) ...
        assert await router.choose_replicas(replicas, _pending((1, 2, 99), "slow")) == [[b]]
    ranks = await router.choose_replicas(replicas, _pending((1, 2, 99), "slow"))
    assert ranks[0] == [b] and sorted(r.replica_id.unique_id for rank in ranks[1:] for r in rank) == ["a", "c"]
    router.on_request_routed(_pending((1, 2, 99), "slow"), b.replica_id, None)
    assert "slow" not in router.attempts, "... then the others after it"
    assert (await router.choose_replicas(replicas, _pending((1, 2, 3, 4))))[0] == [b]
    router.on_request_routed(_pending((7, 8)), c.replica_id, None)
    assert (await router.choose_replicas(replicas, _pending((7, 8, 9))))[0] == [c], "the longest known prefix wins"

    # b far busier than the least loaded replica: balance instead.
    for _ in range(5):
        router.replica_queue_len_cache.update(b.replica_id, 5)
    router.replica_queue_len_cache.update(a.replica_id, 0)
    router.replica_queue_len_cache.update(c.replica_id, 0)
    ranks = await router.choose_replicas(replicas, _pending((1, 2, 3)))
    assert ranks[0] != [b]
    assert router.owners[3] == ranks[0][0].replica_id, "the prefix moves with it"
    router.on_request_routed(_pending((1, 2, 3)), b.replica_id, None)  # the router sent it to b after all
    router.replica_queue_len_cache.update(b.replica_id, 4)
    assert (await router.choose_replicas(replicas, _pending((1, 2, 3))))[0] == [b], "within max_imbalance"

    def owned() -> Counter[Any]:
        return +router.owned  # without zero counts

    assert owned() == Counter(router.owners.values()), "the counts follow the table"
    before = owned()
    router.on_request_routed(_pending((1, 2)), c.replica_id, None)
    assert owned() == Counter(router.owners.values())
    assert owned()[c.replica_id] == before[c.replica_id] + 2, "blocks change owner"

    # b dies: a replica no longer listed is never chosen, and its prefixes move on.
    router.on_replica_actor_died(b.replica_id)
    assert b.replica_id not in router.owned
    ranks = await router.choose_replicas([a, c], _pending((1, 2, 3)))
    assert all(r in (a, c) for rank in ranks for r in rank)
    assert ranks[0] == [c], "the longest prefix a live replica holds: (1, 2) on c"


async def test_the_router_asks_ray_to_back_off_between_attempts() -> None:
    router = _router()
    pending = _pending((1,))
    assert not pending.routing_context.should_backoff
    await router.choose_replicas([_FakeReplica("a")], pending)  # type: ignore[list-item]
    assert pending.routing_context.should_backoff, "or a request waiting for a full replica would spin"
    with pytest.raises(TypeError):
        router.initialize_state(max_imbalance=1, max_entries=10, misspelled=3)  # type: ignore[call-arg]


async def test_the_router_forgets_the_least_recently_used_blocks() -> None:
    router = _router()
    router.initialize_state(max_imbalance=4, max_entries=3)
    replica = _FakeReplica("a")
    router.on_request_routed(_pending((1, 2)), replica.replica_id, None)
    router.on_request_routed(_pending((3, 4)), replica.replica_id, None)
    assert list(router.owners) == [2, 3, 4]
    assert router.routed == 2
    with pytest.raises(ValueError, match="max_imbalance"):
        router.initialize_state(max_imbalance=-1)


# ------------------------------------------------------------------ forwarding


def _forwarded(path: str, body: dict[str, Any] | None = None, method: str = "POST") -> ForwardedRequest:
    raw = b"" if body is None else json.dumps(body).encode()
    headers = ((b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()))
    return ForwardedRequest(method, path, b"", headers, raw, ("127.0.0.1", 5000))


async def _collect(parts: Any) -> tuple[ResponseStart, bytes]:
    start: ResponseStart | None = None
    body = b""
    async for part in parts:
        if isinstance(part, ResponseStart):
            start = part
        else:
            body += part
    assert start is not None
    return start, body


async def test_run_asgi_gives_the_same_response_as_the_app_over_http(model: PreTrainedModel, tokenizer: Any) -> None:
    async with aiocb.Manager(model, continuous_batching_config=serve_config()) as manager:
        app = build_server(manager, tokenizer, MODEL_NAME)
        request = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
        start, body = await _collect(run_asgi(app, _forwarded("/v1/completions", request), ((b"x-extra", b"1"),)))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            direct = await http.post("/v1/completions", json=request)
        assert start.status == 200 and (b"x-extra", b"1") in start.headers
        assert json.loads(body)["choices"] == direct.json()["choices"]

        start, body = await _collect(run_asgi(app, _forwarded("/v1/models", method="GET")))
        assert start.status == 200 and json.loads(body)["data"][0]["id"] == MODEL_NAME
        start, body = await _collect(run_asgi(app, _forwarded("/v1/completions", {"model": "other", "prompt": "x"})))
        assert start.status == 404 and json.loads(body)["error"]["param"] == "model"

        stream = {**request, "stream": True, "max_tokens": 4}
        start, body = await _collect(run_asgi(app, _forwarded("/v1/completions", stream)))
        assert start.status == 200
        events = [line for line in body.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3


async def test_a_body_s_request_id_names_the_request_though_the_proxy_gave_it_an_id(
    model: PreTrainedModel, tokenizer: Any
) -> None:
    """Ray Serve's proxy gives every request an X-Request-Id (the client's, or one it makes):
    the ingress moves it aside, so that a body's ``request_id`` names the request on the
    replica as it does in one process, and the proxy's id names one without."""
    from starlette.requests import Request

    from aiocb.ray_serve.ingress import Ingress

    sent: list[ForwardedRequest] = []

    class Stream:
        async def __anext__(self) -> Any:
            raise StopAsyncIteration

        def cancel(self) -> None:
            pass

    class Handle:
        def options(self, **_: Any) -> Handle:
            return self

        @property
        def forward(self) -> Any:
            return SimpleNamespace(remote=lambda forwarded: sent.append(forwarded) or Stream())

    ingress = Ingress(Handle(), ServerLimits(), BLOCK_CHARS)  # type: ignore[arg-type]
    completion = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}
    # (the last: a client's id the proxy passed on, which cannot name the response as the
    # proxy's header will: refused, as one process refuses it)
    for body, given in [
        ({**completion, "request_id": "mine-42"}, b"proxy-7"),
        (completion, b"proxy-7"),
        (completion, b"my id"),
    ]:
        raw = json.dumps(body).encode()

        async def receive(raw: bytes = raw) -> dict[str, Any]:
            return {"type": "http.request", "body": raw, "more_body": False}

        headers = [(b"content-length", str(len(raw)).encode()), (b"x-request-id", given)]
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
        await ingress(Request(scope, receive))
    async with aiocb.Manager(model, continuous_batching_config=serve_config()) as manager:
        app = build_server(manager, tokenizer, MODEL_NAME)
        named = [await _collect(run_asgi(app, forwarded)) for forwarded in sent]
    assert [json.loads(body)["id"] for _, body in named[:2]] == ["cmpl-mine-42", "cmpl-proxy-7"]
    assert [dict(start.headers)[b"x-request-id"] for start, _ in named[:2]] == [b"mine-42", b"proxy-7"]
    start, refused = named[2]
    assert start.status == 400 and json.loads(refused)["error"]["param"] == "X-Request-Id"


@pytest.mark.parametrize("stream", [True, False])
async def test_closing_the_forwarded_response_cancels_the_request_and_frees_its_blocks(
    model: PreTrainedModel, tokenizer: Any, stream: bool
) -> None:
    async with aiocb.Manager(model, continuous_batching_config=serve_config()) as manager:
        app = build_server(manager, tokenizer, MODEL_NAME)
        request = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 900, "stream": stream}
        parts = run_asgi(app, _forwarded("/v1/completions", request))
        if stream:
            assert isinstance(await anext(parts), ResponseStart)
            await anext(parts)  # a first chunk: the request runs
        else:
            pending = asyncio.ensure_future(anext(parts))
            await wait_until_running(manager, 1)
            pending.cancel()  # the caller is cancelled (Ray's cancellation of a gone client's call)
            with pytest.raises(asyncio.CancelledError):
                await pending
        started = time.perf_counter()
        await parts.aclose()
        assert time.perf_counter() - started < 0.5, "the app heard of the disconnect; no grace period ran out"
        stats = await wait_until_idle(manager)
        assert stats.running_requests == 0 and stats.free_blocks == stats.total_blocks
        assert stats.tokens_generated < 900, "cancelled, not run to its end"


# ------------------------------------------------------------------ build_app's checks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_replicas": 2, "autoscaling_config": {}}, "goes with num_replicas='auto'"),
        ({"routing": "power_of_two", "max_imbalance": 4}, "max_imbalance is prefix-affinity"),
        ({"log_level": "loud"}, "log_level"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"num_replicas": "many"}, "num_replicas"),
        ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 1}}, "autoscaling_config"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"tensor_parallel_size": 2}, "model path"),
        ({"routing": "random"}, "routing"),
        ({"max_ongoing_requests": 0}, "max_ongoing_requests"),
        ({"max_imbalance": -1}, "max_imbalance"),
        ({"health_check_period_s": 0}, "health_check"),
        ({"ray_actor_options": ["num_cpus"]}, "ray_actor_options"),
        ({"no_such_option": 1}, "unknown server options: no_such_option"),
        ({"dtype": "int8"}, "dtype"),
        ({"tool_call_parser": "xml"}, "tool_call_parser"),
        ({"reasoning_parser": "nope"}, "reasoning_parser"),
        ({"limits": {"max_request_bytes": 1}}, "limits must be a ServerLimits"),
        ({"limits": ServerLimits(send_timeout=5)}, "limits.send_timeout does not apply to replicas"),
        ({"continuous_batching_config": {}}, "continuous_batching_config"),
        ({"torch_threads": 0}, "torch_threads"),
        ({"torch_threads": 100_000}, "torch_threads must be an int from 1 to 1024"),
        # (each of these reached the replicas, or Ray's own checks, before: every replica failed on it)
        ({"torch_threads": 1.5}, r"torch_threads must be an int from 1 to 1024, got 1\.5"),
        ({"device": "tpu"}, "device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        ({"shutdown_timeout": "10"}, "shutdown_timeout must be a finite number of seconds, 0 or more, got '10'"),
        ({"shutdown_timeout": float("nan")}, "shutdown_timeout must be a finite number"),
        ({"health_check_period_s": "x"}, "health_check_period_s must be a finite number of seconds, above 0"),
        ({"health_check_timeout_s": float("nan")}, "health_check_timeout_s must be a finite number"),
        ({"max_imbalance": "3"}, "max_imbalance must be an int >= 0, got '3'"),
        ({"max_imbalance": 1.5}, "max_imbalance must be an int >= 0"),
        ({"access_log": "no"}, "access_log must be True or False, got 'no'"),
        ({"trust_remote_code": 1}, "trust_remote_code must be True or False"),
        ({"chat_template": 5}, "chat_template must be the template's text, got 5"),
        ({"chat_template": "{% if %}"}, "chat_template: not a Jinja template transformers can compile"),
        ({"chat_template": " "}, "chat_template: the template is empty"),
        ({"api_key": ""}, "api_key must be a key that is not empty, or None for no key; got an empty string"),
        ({"api_key": 5}, "api_key must be a key that is not empty, or None for no key; got int"),
        # (the bundled model's template is no harmony: checked here, not by every replica)
        ({"reasoning_parser": "openai_gptoss"}, "'openai_gptoss' parser reads gpt-oss's harmony format"),
        # (each replica sees the GPUs Ray gives it alone, numbered from 0)
        ({"device": "cuda", "ray_actor_options": {"num_cpus": 1}}, r"device='cuda', but ray_actor_options give each"),
        ({"device": "cuda:1", "ray_actor_options": {"num_gpus": 1}}, r"sees only the 1 GPU\(s\) Ray gives it"),
        ({"device": "cuda:1", "ray_actor_options": {"num_gpus": 0.5}}, r"sees only the 1 GPU\(s\)"),
        ({"autoscaling_config": [("max_replicas", 8)]}, "autoscaling_config must be a dict"),
        # (as `aiocb serve` refuses --return-logprobs: a server's requests always say)
        ({"continuous_batching_config": aiocb.ContinuousBatchingConfig(return_logprobs=True)}, "return_logprobs"),
    ],
)
def test_build_app_refuses_bad_options_by_name(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message):
        build_app(None, **kwargs)


def test_build_app_checks_the_parsers_against_the_chat_template_given() -> None:
    """The replicas read chat outputs by ``chat_template`` where it is given: so is the
    startup check, for a local tokenizer and a hub id alike."""
    harmony = "<|start|>{{ messages[0].content }}<|end|><|start|>assistant<|channel|>final<|message|>"
    for model in (None, "some-org/some-model"):
        build_app(model, chat_template=harmony, reasoning_parser="openai_gptoss", tool_call_parser="openai")
        with pytest.raises(InvalidConfigError, match="harmony format, whose tool-call parser is 'openai'"):
            build_app(model, chat_template=harmony, tool_call_parser="hermes")
    with pytest.raises(InvalidConfigError, match="'openai_gptoss' parser reads gpt-oss's harmony format"):
        build_app("some-org/some-model", chat_template="{{ messages }}", reasoning_parser="openai_gptoss")


def test_build_app_refuses_a_local_model_whose_tokenizer_does_not_load(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InvalidConfigError, match=f"the tokenizer in {tmp_path} does not load"):
        build_app(tmp_path)


def test_build_app_takes_a_cuda_device_the_replicas_have() -> None:
    for device, gpus in (("cuda", 0.25), ("cuda:0", 1), ("cuda:1", 2)):
        app = build_app(None, device=device, ray_actor_options={"num_gpus": gpus})
        assert app._bound_deployment.init_args[0]._bound_deployment.init_args[1].device == device


def test_build_app_takes_numpy_numbers_as_python_s() -> None:
    import numpy as np

    app = build_app(
        None,
        torch_threads=np.int64(2),
        shutdown_timeout=np.float32(5),
        access_log=np.bool_(False),
        health_check_period_s=np.int64(7),
        max_imbalance=np.int64(3),
    )
    engine = app._bound_deployment.init_args[0]._bound_deployment
    options = engine.init_args[1]
    assert (options.torch_threads, options.shutdown_timeout, options.access_log) == (2, 5.0, False)
    assert type(options.torch_threads) is int and type(options.access_log) is bool
    assert engine._deployment_config.health_check_period_s == 7.0
    kwargs = engine._deployment_config.request_router_config.request_router_kwargs
    assert kwargs["max_imbalance"] == 3 and type(kwargs["max_imbalance"]) is int


def test_replica_options_take_transformers_own_config() -> None:
    from transformers import ContinuousBatchingConfig as TransformersConfig

    from aiocb.ray_serve.options import ReplicaOptions

    options = ReplicaOptions(continuous_batching_config=TransformersConfig(page_size=16, num_blocks=40))
    assert isinstance(options.continuous_batching_config, aiocb.ContinuousBatchingConfig)
    assert (options.continuous_batching_config.page_size, options.continuous_batching_config.num_blocks) == (16, 40)


def test_a_tensor_parallel_rank_s_group_waits_as_long_as_cpu_group_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's own all-reduces wait as long as the process group's timeout: a follower
    left in one when rank 0's forward failed midway would wait gloo's 30 minutes."""
    import datetime

    import torch.distributed as dist

    from aiocb.config import MAX_CPU_GROUP_TIMEOUT
    from aiocb.ray_serve.options import ReplicaOptions
    from aiocb.ray_serve.tensor_parallel import join_and_load

    joined: list[dict[str, Any]] = []

    class Joined(Exception):
        pass

    def init_process_group(backend: str, **kwargs: Any) -> None:
        joined.append(kwargs)
        raise Joined

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    # (join_and_load sets torchrun's variables in this process: put back as they were after,
    # or every later test of the process ran as a torchrun rank)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for timeout in (42.0, None):
        options = ReplicaOptions(
            device="cpu", continuous_batching_config=aiocb.ContinuousBatchingConfig(cpu_group_timeout=timeout)
        )
        with pytest.raises(Joined):
            join_and_load("unused", options, 0, 2, "127.0.0.1", 1)
    assert joined[0]["timeout"] == datetime.timedelta(seconds=42)
    assert joined[1]["timeout"] == datetime.timedelta(seconds=MAX_CPU_GROUP_TIMEOUT)  # (None: for ever)


def test_build_app_checks_tensor_parallelism_against_the_model_config(model_dir: Any) -> None:
    with pytest.raises(InvalidConfigError, match="num_key_value_heads"):
        build_app(model_dir, tensor_parallel_size=3)
    with pytest.raises(InvalidConfigError, match="a GPU of its own"):
        build_app(model_dir, tensor_parallel_size=2, device="cuda:1")
    bundles = build_app(model_dir, tensor_parallel_size=2, ray_actor_options={"num_cpus": 2, "resources": {"fast": 1}})
    engine = bundles._bound_deployment.init_args[0]._bound_deployment
    assert engine._replica_config.placement_group_bundles == [{"CPU": 2.0, "fast": 1.0}] * 2
    # Each bundle holds all the replica's actor asks Ray for (else rank 0's bundle cannot
    # take it, and the replica is never scheduled); each follower asks for as much.
    given = {"num_cpus": 1, "memory": 1 << 28, "accelerator_type": "H100", "runtime_env": {"env_vars": {"A": "1"}}}
    engine = build_app(model_dir, tensor_parallel_size=2, ray_actor_options=given)._bound_deployment.init_args[0]
    bundle = {"CPU": 1.0, "memory": float(1 << 28), "accelerator_type:H100": 0.001}
    assert engine._bound_deployment._replica_config.placement_group_bundles == [bundle] * 2
    assert engine._bound_deployment.init_args[3] == given
    with pytest.raises(InvalidConfigError, match="each rank's placement-group bundle must hold some resource"):
        build_app(model_dir, tensor_parallel_size=2, ray_actor_options={"num_cpus": 0})


def test_build_app_defaults() -> None:
    ingress = build_app(None)._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    assert ingress.name == "AiocbIngress"
    assert engine.name == "AiocbEngine"
    assert engine.num_replicas == 1
    # (room for the server's own 429s beyond its max_concurrent_requests, and for probes)
    assert engine.max_ongoing_requests == ServerLimits().max_concurrent_requests + aiocb.ray_serve.PROBE_ROOM
    with pytest.raises(InvalidConfigError, match=r"max_ongoing_requests \(64\) must be at least"):
        build_app(None, max_ongoing_requests=64)
    small = build_app(None, max_ongoing_requests=64, limits=ServerLimits(max_concurrent_requests=48))
    assert small._bound_deployment.init_args[0]._bound_deployment.max_ongoing_requests == 64
    unbounded = build_app(None, limits=ServerLimits(max_concurrent_requests=0))  # (0: no bound, not 16)
    assert unbounded._bound_deployment.init_args[0]._bound_deployment.max_ongoing_requests == 8192
    router = engine._deployment_config.request_router_config
    assert router.request_router_class.endswith("PrefixAffinityRouter")
    scaled = build_app(None, num_replicas="auto")._bound_deployment.init_args[0]._bound_deployment
    assert scaled._deployment_config.autoscaling_config.target_ongoing_requests == 64
    tuned = build_app(None, num_replicas="auto", autoscaling_config={"max_replicas": 8})
    config = tuned._bound_deployment.init_args[0]._bound_deployment._deployment_config.autoscaling_config
    assert (config.max_replicas, config.target_ongoing_requests) == (8, 64), "the other keys keep aiocb's defaults"
    from ray.serve.config import AutoscalingConfig

    ray_own = build_app(None, num_replicas="auto", autoscaling_config=AutoscalingConfig(max_replicas=6))
    config = ray_own._bound_deployment.init_args[0]._bound_deployment._deployment_config.autoscaling_config
    assert (config.max_replicas, config.target_ongoing_requests) == (6, 64)


async def test_a_burst_of_new_prefixes_spreads_over_the_replicas_before_any_is_routed() -> None:
    router = _router()
    a, b = _FakeReplica("a"), _FakeReplica("b")
    chosen = [
        (await router.choose_replicas([a, b], _pending((tenant, tenant + 1))))[0][0] for tenant in range(0, 80, 10)
    ]
    assert Counter(r.replica_id.unique_id for r in chosen) == {"a": 4, "b": 4}
    again = [
        (await router.choose_replicas([a, b], _pending((tenant, tenant + 1))))[0][0] for tenant in range(0, 80, 10)
    ]
    assert again == chosen, "each prefix's later requests follow it"


def test_a_model_given_by_a_relative_path_is_served_under_that_name(
    model_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replicas load it by its absolute path, but clients name it as one process's
    ``aiocb serve`` serves it: as given."""
    monkeypatch.chdir(model_dir.parent)
    engine = build_app(model_dir.name)._bound_deployment.init_args[0]._bound_deployment
    source, options = engine.init_args[0], engine.init_args[1]
    assert source == str(model_dir.resolve())
    assert options.served_model_name == model_dir.name
    named = build_app(model_dir.name, served_model_name="mine")._bound_deployment.init_args[0]._bound_deployment
    assert named.init_args[1].served_model_name == "mine"
    # (a tokenizer and a draft model given by relative paths, likewise: else read as hub ids)
    drafted = aiocb.SpeculativeConfig(method="draft", draft_model=model_dir.name, num_speculative_tokens=2)
    app = build_app(model_dir.name, tokenizer=model_dir.name, speculative_config=drafted)
    options = app._bound_deployment.init_args[0]._bound_deployment.init_args[1]
    assert options.tokenizer == options.speculative_config.draft_model == str(model_dir.resolve())
    assert (
        build_app(None, tokenizer="org/tok")._bound_deployment.init_args[0]._bound_deployment.init_args[1].tokenizer
        == "org/tok"
    )


async def test_a_replica_lost_mid_stream_ends_the_event_stream_with_an_error_and_done() -> None:
    from ray.exceptions import RayActorError

    from aiocb.ray_serve.ingress import _rest

    async def dying() -> Any:
        yield b'data: {"choices": []}\n\n'
        raise RayActorError()

    chunks = [chunk async for chunk in _rest(dying(), event_stream=True)]  # type: ignore[arg-type]
    assert len(chunks) == 3 and chunks[-1] == b"data: [DONE]\n\n"
    error = json.loads(chunks[1].removeprefix(b"data: "))["error"]
    assert error["type"] == "service_unavailable" and "replica" in error["message"]


async def test_the_ingress_refuses_bodies_as_one_process_s_server_does() -> None:
    """Too large by its Content-Length before it is read (the size named, the connection
    closed), too slow (408 naming the flag), or the client gone (499); the ingress's own
    503 (a replica lost before its response began) says when to retry, as the replicas' do."""
    from starlette.requests import Request

    from aiocb.ray_serve.ingress import Ingress
    from aiocb.server.protocol import APIError

    class Handle:
        def options(self, **_: Any) -> Handle:
            return self

    limits = ServerLimits(max_request_bytes=100, body_timeout=0.05)
    ingress = Ingress(Handle(), limits, BLOCK_CHARS)  # type: ignore[arg-type]

    def request(headers: list[tuple[bytes, bytes]], messages: list[dict[str, Any]], wait: float = 0.0) -> Request:
        async def receive() -> dict[str, Any]:
            if wait:
                await asyncio.sleep(wait)
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
        return Request(scope, receive)

    never_read: list[dict[str, Any]] = []
    with pytest.raises(APIError) as caught:
        await ingress._body(request([(b"content-length", b"5000")], never_read))
    assert caught.value.status == 413 and "(5000 bytes)" in caught.value.message
    assert ingress._error(caught.value).headers["connection"] == "close"
    unavailable = ingress._error(APIError(503, "the replica serving this request failed", type="service_unavailable"))
    assert unavailable.headers["retry-after"] == str(limits.retry_after)
    sent = [{"type": "http.request", "body": b"{}", "more_body": False}]
    assert await ingress._body(request([(b"content-length", b"\xb2")], sent)) == b"{}"
    with pytest.raises(APIError) as caught:
        await ingress._body(request([], [{"type": "http.request", "body": b"{", "more_body": True}], wait=0.2))
    assert caught.value.status == 408 and "(--body-timeout)" in caught.value.message
    with pytest.raises(APIError) as caught:
        await ingress._body(request([], []))
    assert caught.value.status == 499 and caught.value.type == "client_closed_request"


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused_not_taken_as_none(key: str) -> None:
    """An empty ``$AIOCB_API_KEY`` left a server open without a word."""
    with pytest.raises(InvalidConfigError, match="api_key must be a key that is not empty"):
        build_server(None, None, "m", api_key=key)  # type: ignore[arg-type]


async def test_the_ingress_refuses_a_client_without_the_api_key_before_reading_its_body() -> None:
    """As a replica would refuse it, but an unauthenticated client sends no body through."""
    from starlette.requests import Request

    from aiocb.ray_serve.ingress import Ingress

    class Handle:
        def options(self, **_: Any) -> Handle:
            return self

    ingress = Ingress(Handle(), ServerLimits(max_request_bytes=100), BLOCK_CHARS, "sesame")  # type: ignore[arg-type]
    received: list[str] = []

    async def receive() -> dict[str, Any]:
        received.append("read")
        return {"type": "http.request", "body": b"x" * 5000}

    for authorization in (None, b"Bearer nope", b"Basic sesame"):
        headers = [(b"content-length", b"5000")] + ([(b"authorization", authorization)] if authorization else [])
        scope = {"type": "http", "method": "POST", "path": "/qwen/v1/completions", "root_path": "/qwen"}
        response = await ingress(Request({**scope, "headers": headers}, receive))
        assert response.status_code == 401 and b"invalid_api_key" in response.body
    assert not received
    # With the key, the body is read (and refused here for its size, as without a key).
    headers = [(b"content-length", b"5000"), (b"authorization", b"Bearer sesame")]
    response = await ingress(Request({**scope, "headers": headers}, receive))
    assert response.status_code == 413


async def test_a_replica_whose_engine_died_fails_requests_before_their_response_starts() -> None:
    """In the moment before it exits, a replica whose engine is dead fails new requests
    before their response starts: the ingress answers them 503 (retry), as a lost replica's,
    not with its server's 500."""
    from types import SimpleNamespace

    from aiocb.ray_serve.forwarding import ForwardedRequest
    from aiocb.ray_serve.replica import EngineReplica, ReplicaLeavingError

    replica = SimpleNamespace(manager=SimpleNamespace(is_dead=True), replica_id="r1")
    request = ForwardedRequest(
        method="GET", path="/health", query_string=b"", headers=(), body=b"", client=None, prefix=(), replica=None
    )
    with pytest.raises(ReplicaLeavingError, match="replica r1: its engine is dead"):
        await EngineReplica.forward(replica, request).__anext__()  # type: ignore[arg-type]
