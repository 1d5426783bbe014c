"""Two aiocb replicas of the bundled model on a local Ray instance (CPU), through the ingress:
routing, prefix hits against a single replica, streaming with the openai client,
cancellation, a replica killed mid-burst and a dead engine replaced."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray
from ray import serve

import aiocb
from aiocb.cli.serve import load_pretrained
from aiocb.ray_serve import REPLICA_HEADER, build_app
from aiocb.ray_serve.tensor_parallel import FOLLOWER_NAMESPACE, follower_name
from aiocb.server import build_app as build_server
from tests.distributed.launch import free_port

pytestmark = pytest.mark.multiprocess

MODEL = "pycode-tiny"
CONFIG = aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=1024)
#: 8 tenants' system prompts of about 1,000 characters, different from their first line.
SYSTEMS = [
    f"# tenant {tenant}: you maintain module_{tenant}.py\n"
    + "".join(f"def helper_{tenant}_{i}(value):\n    return value * {tenant + i} + {i}\n\n" for i in range(16))
    for tenant in range(8)
]
USERS = 64
POISON = 7  # the token id the poisoned model refuses


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray instance with Serve's HTTP proxy on a free port; its base URL."""
    ray.init(
        num_cpus=8,  # logical: the replicas take 1 each, the ingress none
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def replicas(cluster: str) -> str:
    """Two replicas of the bundled model with prefix-affinity routing, at ``/``."""
    app = build_app(None, num_replicas=2, torch_threads=1, continuous_batching_config=CONFIG)
    serve.run(app, name="aiocb", route_prefix="/")
    return cluster


def _completion(prompt: str, max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


async def test_requests_reach_both_replicas_and_match_one_engine(replicas: str) -> None:
    prompts = [f"def function_{i}(argument_{i}):\n" for i in range(24)]
    async with httpx.AsyncClient(base_url=replicas, timeout=60) as http:
        responses = await asyncio.gather(*(http.post("/v1/completions", json=_completion(p, 8)) for p in prompts))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    served_by = Counter(r.headers[REPLICA_HEADER] for r in responses)
    assert len(served_by) == 2, f"prompts that share nothing are balanced over both replicas: {served_by}"

    model, tokenizer = load_pretrained(None)
    async with aiocb.Manager(model, continuous_batching_config=CONFIG) as manager:
        app = build_server(manager, tokenizer, MODEL)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as local:
            expected = [(await local.post("/v1/completions", json=_completion(p, 8))).json() for p in prompts]
    assert [r.json()["choices"][0]["text"] for r in responses] == [e["choices"][0]["text"] for e in expected]


async def _multi_tenant(http: httpx.AsyncClient, concurrency: int = 16) -> tuple[int, Counter[tuple[int, str]]]:
    """Every user of every tenant once, users in turn across tenants; (cached prompt tokens, tenant x replica)."""
    limit = asyncio.Semaphore(concurrency)
    placement: Counter[tuple[int, str]] = Counter()

    async def one(tenant: int, user: int) -> int:
        async with limit:
            body = _completion(SYSTEMS[tenant] + f"# user {user} asks for a test of helper_{tenant}_{user % 16}\n")
            response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        placement[(tenant, response.headers.get(REPLICA_HEADER, "local"))] += 1
        cached: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return cached

    hits = await asyncio.gather(*(one(t, u) for u in range(USERS) for t in range(len(SYSTEMS))))
    return sum(hits), placement


async def test_shared_prefixes_get_a_single_replica_s_prefix_hits(replicas: str) -> None:
    async with httpx.AsyncClient(base_url=replicas, timeout=120) as http:
        routed_hits, placement = await _multi_tenant(http)

    model, tokenizer = load_pretrained(None)
    async with aiocb.Manager(model, continuous_batching_config=CONFIG) as manager:
        app = build_server(manager, tokenizer, MODEL)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as local:
            single_hits, _ = await _multi_tenant(local)

    assert single_hits > 0
    assert routed_hits >= 0.9 * single_hits, f"prefix hits: {routed_hits} routed, {single_hits} on one engine"
    for tenant in range(len(SYSTEMS)):
        counts = sorted((n for (t, _), n in placement.items() if t == tenant), reverse=True)
        assert counts[0] >= 0.9 * USERS, f"tenant {tenant}'s requests stay on one replica: {placement}"
    assert len({replica for _, replica in placement}) == 2, f"the tenants are spread over both replicas: {placement}"


def test_the_openai_client_streams_through_the_ingress(replicas: str) -> None:
    client = openai.OpenAI(base_url=f"{replicas}/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.completions.create(model=MODEL, prompt="def add(a, b):\n", max_tokens=8, temperature=0, stream=True)
    )
    whole = client.completions.create(model=MODEL, prompt="def add(a, b):\n", max_tokens=8, temperature=0)
    assert len(chunks) >= 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in chat if c.choices]
    assert len(pieces) >= 2
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


async def _metric(http: httpx.AsyncClient, replica: str, name: str) -> float:
    """The value of ``name`` in ``replica``'s ``/metrics`` (asked for by its header)."""
    response = await http.get("/metrics", headers={REPLICA_HEADER: replica})
    assert response.headers[REPLICA_HEADER] == replica
    for line in response.text.splitlines():
        if line.startswith(name + "{"):
            assert f'replica="{replica}"' in line, line  # (series of replicas kept apart)
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in {response.text[:200]!r}")


async def test_a_request_can_ask_for_a_replica(replicas: str) -> None:
    async with httpx.AsyncClient(base_url=replicas, timeout=60) as http:
        seen = {(await http.get("/v1/models")).headers[REPLICA_HEADER] for _ in range(20)}
        for replica in seen:
            responses = [await http.get("/health", headers={REPLICA_HEADER: replica}) for _ in range(5)]
            assert {r.headers[REPLICA_HEADER] for r in responses} == {replica}
        unknown = await http.get("/health", headers={REPLICA_HEADER: "no-such-replica"})
        assert unknown.status_code == 200, "a replica that is not there: routed as usual"


async def test_a_client_that_goes_away_cancels_its_request_on_the_replica(replicas: str) -> None:
    async with httpx.AsyncClient(base_url=replicas, timeout=60) as http:
        body = _completion("def long_function():\n", 900, stream=True, ignore_eos=True)
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            replica = response.headers[REPLICA_HEADER]
            generated = await _metric(http, replica, "aiocb_generation_tokens_total")
            lines = response.aiter_lines()  # held: a dropped iterator closes the stream when collected
            await anext(lines)
            assert await _metric(http, replica, "aiocb_num_requests_running") == 1
        deadline = time.monotonic() + 10
        while await _metric(http, replica, "aiocb_num_requests_running") > 0:
            assert time.monotonic() < deadline, "the request still runs after its client left"
            await asyncio.sleep(0.1)
        tokens = await _metric(http, replica, "aiocb_generation_tokens_total") - generated
        assert tokens < 900, f"cancelled after {tokens:.0f} of its 900 tokens, not run to its end"


async def test_killing_a_replica_mid_burst_fails_only_its_requests(replicas: str) -> None:
    """Last of the two-replica tests: it takes one replica away (Ray starts another)."""
    outcomes: list[tuple[str, str]] = []  # (replica or "", outcome)
    started = asyncio.Event()

    async def streamed(http: httpx.AsyncClient, i: int) -> None:
        body = _completion(f"def burst_{i}(x):\n", 300, stream=True, ignore_eos=True)
        async with http.stream("POST", "/v1/completions", json=body) as response:
            replica = response.headers.get(REPLICA_HEADER, "")
            if response.status_code != 200:
                outcomes.append((replica, f"http {response.status_code}"))
                return
            events = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
            last = json.loads(events[-2]) if events[-1] == "[DONE]" else json.loads(events[-1])
            outcomes.append((replica, "error" if "error" in last else "ok"))

    async with httpx.AsyncClient(base_url=replicas, timeout=60) as http:
        tasks = [asyncio.create_task(streamed(http, i)) for i in range(16)]
        await asyncio.wait_for(started.wait(), 30)
        await asyncio.sleep(0.5)
        on_replica = Counter(r.headers[REPLICA_HEADER] for r in [await http.get("/v1/models") for _ in range(6)])
        victim = next(iter(on_replica))
        ray.kill(ray.get_actor(f"SERVE_REPLICA::aiocb#AiocbEngine#{victim}", namespace="serve"), no_restart=True)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)  # nothing hangs

        survivors = [outcome for replica, outcome in outcomes if replica and replica != victim]
        failed = [(replica, outcome) for replica, outcome in outcomes if outcome != "ok"]
        assert survivors and set(survivors) == {"ok"}, outcomes
        assert failed, "the killed replica had requests in flight"
        assert all(replica in (victim, "") for replica, _ in failed), outcomes
        after = [await http.post("/v1/completions", json=_completion("def after(x):\n", 4)) for _ in range(6)]
        assert [r.status_code for r in after] == [200] * 6, [r.text for r in after]


@pytest.fixture
def poisoned_model_dir(model_dir: Path, tmp_path: Path) -> Path:
    """The server tests' tiny model, whose forward raises on the token :data:`POISON`."""
    path = tmp_path / "poisoned"
    shutil.copytree(model_dir, path)
    (path / "modeling_poison.py").write_text(
        "from transformers import Qwen3ForCausalLM\n\n\n"
        "def _refuse(module, args):\n"
        f"    if bool((args[0] == {POISON}).any()):\n"
        "        raise RuntimeError('poisoned token')\n\n\n"
        "class PoisonedQwen3ForCausalLM(Qwen3ForCausalLM):\n"
        "    def __init__(self, config):\n"
        "        super().__init__(config)\n"
        "        self.model.embed_tokens.register_forward_pre_hook(_refuse)\n"
    )
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_poison.PoisonedQwen3ForCausalLM"}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.slow  # two replicas that load, die and come back: ~35 s of the default session
async def test_a_replica_whose_engine_died_is_replaced(cluster: str, poisoned_model_dir: Path) -> None:
    app = build_app(
        poisoned_model_dir,
        served_model_name="poisoned",
        trust_remote_code=True,
        torch_threads=1,
        continuous_batching_config=aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=64),
        health_check_period_s=0.5,
        health_check_timeout_s=5.0,
    )
    serve.run(app, name="poisoned", route_prefix="/poisoned")
    try:
        async with httpx.AsyncClient(base_url=f"{cluster}/poisoned", timeout=30) as http:
            good = {"model": "poisoned", "prompt": [100, 101, 102], "max_tokens": 3}
            first = await http.post("/v1/completions", json=good)
            assert first.status_code == 200, first.text
            original = first.headers[REPLICA_HEADER]
            killed = await http.post("/v1/completions", json={**good, "prompt": [100, POISON, 102]})
            assert killed.status_code >= 500 and "error" in killed.json()
            health = await http.get("/health")
            assert health.status_code == 503 or health.headers[REPLICA_HEADER] != original

            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                response = await http.post("/v1/completions", json=good)
                if response.status_code == 200 and response.headers[REPLICA_HEADER] != original:
                    break
                await asyncio.sleep(0.5)
            else:
                pytest.fail("Ray did not replace the replica whose engine died")
    finally:
        serve.delete("poisoned")


@pytest.mark.slow  # two more processes loading and joining a gloo group: ~35 s of the default session
async def test_a_tensor_parallel_replica_answers_as_one_process(
    cluster: str, model_dir: Path, model: Any, tokenizer: Any
) -> None:
    app = build_app(
        model_dir,
        served_model_name="sharded",
        tensor_parallel_size=2,
        torch_threads=1,
        continuous_batching_config=aiocb.ContinuousBatchingConfig(page_size=16, num_blocks=64),
    )
    serve.run(app, name="sharded", route_prefix="/sharded")
    try:
        prompts = [[100, 101, 102, 103], [5, 6, 7, 8, 9, 10], [300, 200, 100]]
        async with httpx.AsyncClient(base_url=f"{cluster}/sharded", timeout=60) as http:
            responses = await asyncio.gather(
                *(
                    http.post(
                        "/v1/completions",
                        json={"model": "sharded", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                    )
                    for p in prompts
                )
            )
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        replica = responses[0].headers[REPLICA_HEADER]
        assert ray.get_actor(follower_name(replica, 1), namespace=FOLLOWER_NAMESPACE), "rank 1 runs in its own actor"
        async with aiocb.Manager(model, continuous_batching_config=CONFIG) as manager:
            expected = await manager.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)
        texts = [tokenizer.decode(o.generated_tokens) for o in expected.values()]
        assert [r.json()["choices"][0]["text"] for r in responses] == texts
    finally:
        serve.delete("sharded")
