"""A seeded random mix of everything a request can ask for, in one manager session.

Each case draws ~26 requests: some with ``n`` samples, priorities, sampled or greedy,
with random logits controls and stop tokens, submitted at random steps, consumed by
``generate``, ``get_result(id)`` or ``stream(id)``, and some cancelled at random moments
(``cancel_request``, a cancelled ``generate`` task, a closed stream). The cache is small
and the step budget short, so prompts are chunked and requests (forked samples among
them) are preempted, by the cache running out or by a more urgent request. Then:

1. no block leaks and nothing is left running or waiting;
2. every request that was not cancelled ends FINISHED with ``max_new_tokens`` tokens,
   unless a stop token (not before ``min_tokens``) ended it, as its last token;
3. every seeded or greedy one gives the tokens of the same request run alone afterwards
   (sample ``i`` of seed ``s``: seed ``s + i``), and a cancelled one a prefix of them;
4. greedy ones with no logits control give ``model.generate``'s tokens.

The schedule depends on the timing of the worker thread, so a seed fixes the requests
and when they are submitted or cancelled (in steps), not every interleaving: the
invariants hold for any.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from transformers import PreTrainedModel

import aiocb
from tests.conftest import random_prompts, reference_generate, tiny_qwen3

VOCAB = 512
NUM_REQUESTS = 26
MAX_NEW = 40

CASES: dict[str, tuple[int, dict[str, Any]]] = {
    "fifo-tiny-cache": (0, {"num_blocks": 30, "max_batch_tokens": 32}),
    "fifo-async": (1, {"num_blocks": 40, "max_batch_tokens": 64, "use_async_batching": True}),
    "prefill_first": (2, {"num_blocks": 36, "max_batch_tokens": 48, "scheduler_type": "prefill_first"}),
    "prefill_first-async": (
        3,
        {"num_blocks": 40, "max_batch_tokens": 64, "scheduler_type": "prefill_first", "use_async_batching": True},
    ),
    "prefill_first-tiny-async": (
        5,
        {"num_blocks": 24, "max_batch_tokens": 32, "scheduler_type": "prefill_first", "use_async_batching": True},
    ),
    "fifo-low-margin": (4, {"num_blocks": 44, "max_batch_tokens": 64, "safety_margin": 0.05}),
}


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return tiny_qwen3()


# --------------------------------------------------------------------------- the requests


@dataclass
class Spec:
    """One drawn request (a group of ``n`` samples) and how the test drives it."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    n: int
    params: dict[str, Any]
    via: str  # "generate" | "result" | "stream"
    start_step: int  # submitted once the manager has run this many steps
    cancel: str | None = None  # "task" | "cancel_request" | "close"
    cancel_target: int = 0  # which sample cancel_request / close acts on
    cancel_delay: tuple[str, int] = ("yield", 0)  # ("yield", k): k loop turns; ("steps", k): k steps
    close_after: int = 1  # chunks a closed stream reads first

    @property
    def ids(self) -> list[str]:
        return [self.rid] + [f"{self.rid}__child#{i}" for i in range(self.n - 1)]

    @property
    def sampled(self) -> bool:
        if "temperature" in self.params:
            return float(self.params["temperature"]) > 0.0
        return "min_p" in self.params  # (a sampling filter asks for sampling, at the default temperature)

    @property
    def deterministic(self) -> bool:
        return not self.sampled or "seed" in self.params

    def alone(self, sample: int) -> dict[str, Any]:
        """The kwargs of sample ``sample`` as a request of its own."""
        params = dict(self.params)
        if "seed" in params:
            params["seed"] += sample
        return params


def _controls(rng: random.Random, plain: list[int]) -> dict[str, Any]:
    """0 to 3 logits controls; the tokens come from the plain greedy output, so they bite."""

    def tok() -> int:
        return rng.choice(plain) if rng.random() < 0.7 else rng.randrange(1, VOCAB)

    makers: dict[str, Callable[[], Any]] = {
        "repetition_penalty": lambda: rng.choice([0.7, 1.3, 1.8]),
        "presence_penalty": lambda: rng.choice([-0.5, 1.0, 2.0]),
        "frequency_penalty": lambda: rng.choice([0.5, 1.5]),
        "min_p": lambda: rng.choice([0.05, 0.2]),
        "logit_bias": lambda: {tok(): rng.choice([-100.0, -5.0, 3.0, 8.0]) for _ in range(rng.randint(1, 3))},
        "bad_words_ids": lambda: [[tok()], [tok(), tok()]],
        "sequence_bias": lambda: {(tok(), tok()): rng.choice([-20.0, 6.0]), (tok(),): rng.choice([-4.0, 4.0])},
        "allowed_token_ids": lambda: sorted({*rng.sample(plain, min(4, len(plain))), *rng.sample(range(1, VOCAB), 8)}),
    }
    chosen = rng.sample(sorted(makers), rng.choice([0, 0, 1, 1, 2, 3]))
    return {name: makers[name]() for name in chosen}


def _prompts(rng: random.Random, seed: int) -> list[list[int]]:
    """Random prompts of 1 to 80 tokens; some repeat an earlier one, whole or its first
    block(s) with a new tail, so that forks meet prefix-cache hits."""
    prompts = random_prompts(NUM_REQUESTS, 1, 80, seed=1000 + seed)
    for i in range(2, NUM_REQUESTS):
        if rng.random() < 0.25:
            earlier = prompts[rng.randrange(i)]
            cut = rng.choice([len(earlier), 16 * (len(earlier) // 16), rng.randint(1, len(earlier))])
            prompts[i] = earlier[:cut] + prompts[i][: rng.choice([0, 1, 5, 20])]
            if not prompts[i]:
                prompts[i] = earlier
    return prompts


async def _plain_outputs(model: PreTrainedModel, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations (MAX_NEW tokens): tokens for the controls that change outputs."""
    async with aiocb.Manager(model) as manager:
        outputs = await manager.generate_batch(prompts, max_new_tokens=MAX_NEW)
    return [o.generated_tokens for o in outputs.values()]


def _draw(rng: random.Random, index: int, prompt: list[int], plain: list[int]) -> Spec:
    max_new = rng.choice([1, 2]) if rng.random() < 0.15 else rng.randint(4, MAX_NEW)
    plain = plain[:max_new]
    params: dict[str, Any] = {}
    if rng.random() < 0.6:
        params["temperature"] = rng.choice([0.7, 1.0, 1.3])
        if rng.random() < 0.5:
            params["top_k"] = rng.choice([0, 5, 40])
        if rng.random() < 0.3:
            params["top_p"] = rng.choice([0.8, 0.95])
        if rng.random() < 0.8:
            params["seed"] = rng.randrange(10_000)
    elif rng.random() < 0.5:
        params["temperature"] = 0.0  # greedy said so; otherwise the generation config's greedy
    if rng.random() < 0.5:
        params["priority"] = rng.randint(-2, 3)
    params.update(_controls(rng, plain))
    if rng.random() < 0.4:
        # Stop tokens the request is likely to produce: from its allow-list, or plain greedy's.
        pool = [t for t in params.get("allowed_token_ids", plain) if t != 0]
        params["stop_token_ids"] = sorted(set(rng.sample(pool, min(len(pool), rng.randint(1, 2)))))
        if max_new > 1 and rng.random() < 0.5:
            params["min_tokens"] = rng.randint(1, max_new - 1)
    n = rng.choice([1, 1, 1, 2, 3, 4])
    via = rng.choice(["generate", "result", "stream"])
    spec = Spec(f"r{index}", prompt, max_new, n, params, via, start_step=rng.choice([0, 0, rng.randint(1, 40)]))
    if rng.random() < 0.35:
        spec.cancel = {"generate": "task", "result": "cancel_request"}.get(via) or rng.choice(
            ["cancel_request", "close"]
        )
        spec.cancel_target = rng.randrange(n)
        spec.cancel_delay = rng.choice([("yield", rng.randint(0, 3)), ("steps", rng.randint(1, 12))])
        spec.close_after = rng.randint(1, 3)
    return spec


def _anchor(rng: random.Random, specs: list[Spec], plains: list[list[int]]) -> None:
    """Make five random specs ones that surely show what the mix is about, whatever the
    timing: a greedy pair to check against model.generate, a greedy request that a stop
    token ends, seeded samples, an urgent latecomer, and a cancellation that takes effect."""
    greedy, stopped, samples, urgent, cancelled = (specs[i] for i in rng.sample(range(len(specs)), 5))
    for spec in (greedy, stopped, samples, urgent, cancelled):
        spec.cancel, spec.start_step = None, 0
    greedy.n, greedy.params, greedy.max_new_tokens = 2, {}, max(greedy.max_new_tokens, 4)
    plain = plains[specs.index(stopped)]
    at = next(k for k in range(1, len(plain)) if plain[k] not in plain[:k] and plain[k] != 0)
    stopped.params = {"temperature": 0.0, "stop_token_ids": [plain[at]]}
    stopped.max_new_tokens = rng.randint(at + 2, MAX_NEW)
    samples.n = 3
    samples.params = {**samples.params, "temperature": 1.0, "seed": rng.randrange(10_000)}
    samples.params.pop("stop_token_ids", None)
    urgent.params = {**urgent.params, "priority": -2}
    urgent.start_step = rng.randint(8, 20)
    cancelled.via, cancelled.cancel, cancelled.cancel_delay = "result", "cancel_request", ("steps", 2)
    cancelled.max_new_tokens, cancelled.cancel_target = MAX_NEW, 0
    cancelled.params.pop("stop_token_ids", None)


# --------------------------------------------------------------------------- driving


@dataclass
class Outcome:
    """What the test saw of one sample."""

    spec: Spec
    sample: int
    #: the final output, or the last partial one of a closed stream; None when unknown
    output: aiocb.GenerationOutput | None
    #: cancel_request's answer for this sample, when it was called on it
    cancel_answer: bool | None = None
    chunks: list[aiocb.GenerationOutput] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.spec.ids[self.sample]} {self.spec.params} n={self.spec.n} via={self.spec.via}"


async def _until_step(manager: aiocb.Manager, target: int) -> None:
    """Until the manager has run ``target`` steps, or is idle (the counter would not move)."""
    idle = 0
    while manager.statistics().steps < target and idle < 20:
        stats = manager.statistics()
        idle = 0 if stats.running_requests or stats.waiting_requests else idle + 1
        await asyncio.sleep(0.001)


async def _delay(manager: aiocb.Manager, delay: tuple[str, int]) -> None:
    kind, amount = delay
    if kind == "yield":
        for _ in range(amount):
            await asyncio.sleep(0)
    else:
        await _until_step(manager, manager.statistics().steps + amount)


async def _drive(manager: aiocb.Manager, spec: Spec) -> list[Outcome]:
    await _until_step(manager, spec.start_step)
    kwargs = {"max_new_tokens": spec.max_new_tokens, "n": spec.n, **spec.params}
    if spec.via == "generate":
        task = asyncio.create_task(manager.generate(spec.prompt, request_id=spec.rid, **kwargs))
        if spec.cancel == "task":
            await _delay(manager, spec.cancel_delay)
            task.cancel()
        await asyncio.wait([task])
        if task.cancelled():
            return [Outcome(spec, i, None) for i in range(spec.n)]
        result = task.result()
        outputs = result if isinstance(result, list) else [result]
        assert (spec.n == 1) == (not isinstance(result, list))
        return [Outcome(spec, i, o) for i, o in enumerate(outputs)]

    rid = await manager.add_request(spec.prompt, request_id=spec.rid, **kwargs)
    assert rid == spec.rid
    outcomes = [Outcome(spec, i, None) for i in range(spec.n)]

    async def cancel() -> None:
        await _delay(manager, spec.cancel_delay)
        outcomes[spec.cancel_target].cancel_answer = manager.cancel_request(spec.ids[spec.cancel_target])

    async def read(i: int, stream: aiocb.RequestStream | None) -> None:
        if stream is None:
            outcomes[i].output = await manager.get_result(spec.ids[i])
            return
        closes = spec.cancel == "close" and i == spec.cancel_target
        async with stream:  # leaving it early cancels the request
            async for chunk in stream:
                outcomes[i].chunks.append(chunk)
                if closes and len(outcomes[i].chunks) >= spec.close_after:
                    break
        outcomes[i].output = outcomes[i].chunks[-1]

    # Claim the streams at once: until then the outputs go to the shared results.
    streams = [manager.stream(i) if spec.via == "stream" else None for i in spec.ids]
    async with asyncio.TaskGroup() as group:
        if spec.cancel == "cancel_request":
            group.create_task(cancel())
        for i, stream in enumerate(streams):
            group.create_task(read(i, stream))
    return outcomes


# --------------------------------------------------------------------------- checks


def _check_stream(outcome: Outcome) -> None:
    """Each chunk holds every token so far: a prefix of the next; only the last may be final."""
    chunks = outcome.chunks
    for before, after in itertools.pairwise(chunks):
        assert not before.is_finished(), outcome.name
        assert after.generated_tokens[: len(before.generated_tokens)] == before.generated_tokens, outcome.name
        assert len(after.generated_tokens) > len(before.generated_tokens) or after.is_finished(), outcome.name
    assert all(c.request_id == outcome.spec.ids[outcome.sample] for c in chunks)


def _check_tokens(outcome: Outcome) -> None:
    """What the controls forbid, in any output (final or not): a stop token but as the
    last token of a stopped request, one within ``min_tokens``, a bad word, a token not
    allowed."""
    spec, output = outcome.spec, outcome.output
    assert output is not None
    tokens = output.generated_tokens
    assert output.request_id == spec.ids[outcome.sample]
    assert output.prompt_ids == spec.prompt
    assert all(0 <= t < VOCAB for t in tokens)
    stops = set(spec.params.get("stop_token_ids", ()))
    stopped = output.finish_reason is aiocb.FinishReason.STOP
    assert not stops & set(tokens[:-1] if stopped else tokens), f"a stop token did not stop it: {outcome.name} {tokens}"
    if "allowed_token_ids" in spec.params:
        assert set(tokens) <= set(spec.params["allowed_token_ids"]), outcome.name
    sequence = spec.prompt + tokens
    for word in spec.params.get("bad_words_ids", ()):
        ends = [i + len(word) for i in range(len(sequence) - len(word) + 1) if sequence[i : i + len(word)] == word]
        assert all(end <= len(spec.prompt) for end in ends), f"bad word {word} generated: {outcome.name} {tokens}"


def _check_finished(outcome: Outcome) -> None:
    """Invariant 2 for a request that ran to its end."""
    spec, output = outcome.spec, outcome.output
    assert output is not None
    tokens = output.generated_tokens
    assert output.status is aiocb.RequestStatus.FINISHED, outcome.name
    if output.finish_reason is aiocb.FinishReason.STOP:
        assert tokens[-1] in spec.params.get("stop_token_ids", ()), f"{outcome.name} {tokens}"
        assert output.stop_reason == tokens[-1]
        assert spec.params.get("min_tokens", 0) < len(tokens) <= spec.max_new_tokens, f"{outcome.name} {tokens}"
    else:
        assert output.finish_reason is aiocb.FinishReason.LENGTH, f"{outcome.name}: {output.finish_reason}"
        assert len(tokens) == spec.max_new_tokens, f"{outcome.name} {tokens}"
        assert output.stop_reason is None


def _check_cancelled(outcome: Outcome) -> None:
    """A cancelled request was cancelled by the test, before it could end."""
    spec, output = outcome.spec, outcome.output
    assert output is not None
    # (cancel_request of a request's own id ends its every sample)
    by_us = outcome.sample == spec.cancel_target or (spec.cancel == "cancel_request" and spec.cancel_target == 0)
    assert spec.cancel is not None and by_us, f"not cancelled by us: {outcome.name}"
    assert output.status is aiocb.RequestStatus.CANCELLED, outcome.name
    assert output.finish_reason is aiocb.FinishReason.CANCELLED, outcome.name
    assert len(output.generated_tokens) < spec.max_new_tokens, outcome.name


def _greedy_reference(model: PreTrainedModel, spec: Spec) -> list[int] | None:
    """model.generate's tokens for a greedy request using no logits control (stop tokens and
    min_tokens are EOS and min_new_tokens there), else None."""
    if spec.sampled or not set(spec.params) <= {"temperature", "priority", "stop_token_ids", "min_tokens"}:
        return None
    kwargs: dict[str, Any] = {}
    if "stop_token_ids" in spec.params:
        kwargs["eos_token_id"] = spec.params["stop_token_ids"]
        kwargs["min_new_tokens"] = spec.params.get("min_tokens", 0)
    return reference_generate(model, spec.prompt, spec.max_new_tokens, **kwargs)


async def _run_case(model: PreTrainedModel, seed: int, schedule: dict[str, Any]) -> None:
    rng = random.Random(seed)
    prompts = _prompts(rng, seed)
    plains = await _plain_outputs(model, prompts)
    specs = [_draw(rng, i, p, plain) for i, (p, plain) in enumerate(zip(prompts, plains, strict=True))]
    _anchor(rng, specs, plains)
    config = aiocb.ContinuousBatchingConfig(page_size=16, **schedule)

    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_drive(manager, spec)) for spec in specs]
        outcomes = [o for task in tasks for o in task.result()]
        stats = manager.statistics()
        assert manager._steps is not None
        carried = manager._steps.scheduler.stats.num_carried_tokens
        # 1. Nothing leaked, nothing left behind.
        assert stats.free_blocks == stats.total_blocks, stats
        assert stats.running_requests == 0 and stats.waiting_requests == 0, stats

    # The schedule really was the stressful one.
    assert stats.preemptions > 0, stats
    assert stats.prefix_hit_tokens > 0, stats  # forked samples (and shared prefixes)
    assert max(map(len, prompts)) > schedule["max_batch_tokens"], "no prompt is chunked"
    assert (carried > 0) == bool(schedule.get("use_async_batching")), carried

    # 2. How each one ended.
    finished: list[Outcome] = []
    partial: list[Outcome] = []  # cancelled, with the tokens they had then
    for outcome in outcomes:
        output = outcome.output
        if outcome.chunks:
            _check_stream(outcome)
        if output is not None:
            _check_tokens(outcome)
        if outcome.cancel_answer is not None and output is not None:
            # cancel_request says whether it cancelled a live request (of a request's own id:
            # any of its samples)
            samples = [o for o in outcomes if o.spec is outcome.spec] if outcome.sample == 0 else [outcome]
            cancelled = any(o.output is not None and o.output.status is aiocb.RequestStatus.CANCELLED for o in samples)
            assert outcome.cancel_answer == cancelled, outcome.name
        if output is None:
            assert outcome.spec.cancel == "task", f"no output: {outcome.name}"
        elif output.status is aiocb.RequestStatus.FINISHED:
            _check_finished(outcome)
            finished.append(outcome)
        elif output.is_finished():
            _check_cancelled(outcome)
            partial.append(outcome)
        else:  # a stream closed before the end
            assert outcome.spec.cancel == "close" and outcome.sample == outcome.spec.cancel_target, outcome.name
            partial.append(outcome)

    # 3. Seeded and greedy samples against the same request alone; 4. greedy against model.generate.
    checked = [o for o in finished + partial if o.spec.deterministic]
    alone_outputs: dict[str, aiocb.GenerationOutput] = {}
    async with aiocb.Manager(model) as alone_manager:
        for outcome in checked:
            spec = outcome.spec
            params = spec.alone(outcome.sample)
            key = repr((spec.prompt, spec.max_new_tokens, sorted(params.items())))
            if key not in alone_outputs:  # (a greedy group's samples are one request alone)
                alone_outputs[key] = await alone_manager.generate(spec.prompt, spec.max_new_tokens, n=1, **params)
            alone = alone_outputs[key]
            assert outcome.output is not None
            got = outcome.output.generated_tokens
            if outcome.output.status is aiocb.RequestStatus.FINISHED:
                assert got == alone.generated_tokens, f"batched != alone: {outcome.name}"
                assert outcome.output.finish_reason == alone.finish_reason, outcome.name
            else:
                assert got == alone.generated_tokens[: len(got)], f"cancelled, not a prefix of alone: {outcome.name}"
            reference = _greedy_reference(model, spec)
            if reference is not None and outcome.output.status is aiocb.RequestStatus.FINISHED:
                assert got == reference, f"!= model.generate: {outcome.name}"
        stats = alone_manager.statistics()
        assert stats.free_blocks == stats.total_blocks

    # The mix really had what the test is about.
    checked_finished = [o for o in checked if o.output and o.output.status is aiocb.RequestStatus.FINISHED]
    assert len(checked_finished) >= NUM_REQUESTS // 2, len(checked_finished)
    assert any(o.sample > 0 and o.spec.sampled for o in checked_finished), "no seeded sample of an n-group checked"
    assert any(_greedy_reference(model, o.spec) is not None for o in checked_finished), "no model.generate check"
    assert any(o.spec.params.get("priority", 0) < 0 for o in finished), "no urgent request"
    assert any(o.output and o.output.finish_reason is aiocb.FinishReason.STOP for o in finished), "no stop token"
    assert any(o.output is None or o.output.status is not aiocb.RequestStatus.FINISHED for o in outcomes), (
        "no cancellation took effect"
    )


@pytest.mark.parametrize("case", sorted(CASES))
async def test_random_mix_keeps_blocks_lengths_and_determinism(model: PreTrainedModel, case: str) -> None:
    seed, schedule = CASES[case]
    await _run_case(model, seed, schedule)


# --------------------------------------------------------------------------- found on the way
# A sample cancelled while it waits for its parent's fork used to stay in Scheduler._forks
# until the parent forked or ended: Scheduler.num_held_children still counted it, so did
# statistics().waiting_requests and the max_queue_size backpressure.


async def test_a_sample_cancelled_before_its_fork_no_longer_counts_as_waiting(model: PreTrainedModel) -> None:
    prompt = random_prompts(1, 40, 40, seed=7)[0]
    async with aiocb.Manager(model, continuous_batching_config=aiocb.ContinuousBatchingConfig(page_size=16)) as manager:
        rid = await manager.add_request(prompt, max_new_tokens=4, n=3)  # (no step has run yet)
        assert manager.statistics().waiting_requests == 3  # the parent and its two held samples
        assert manager.cancel_request(f"{rid}__child#0")
        waiting = manager.statistics().waiting_requests
        assert (await manager.get_result(rid)) is not None
        assert (await manager.get_result(f"{rid}__child#1")) is not None
    assert waiting == 2, "a cancelled sample is still counted as waiting"


async def test_samples_cancelled_before_their_fork_free_their_place_in_the_queue(model: PreTrainedModel) -> None:
    prompt, other = random_prompts(2, 40, 40, seed=7)
    config = aiocb.ContinuousBatchingConfig(page_size=16, max_queue_size=3)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        rid = await manager.add_request(prompt, max_new_tokens=4, n=3)  # the queue is full: 3 samples
        assert manager.cancel_request(f"{rid}__child#0") and manager.cancel_request(f"{rid}__child#1")
        try:  # one live request queued out of 3: there is room
            manager.add_request_nowait(other, request_id="other", max_new_tokens=4)
            admitted = True
        except aiocb.WouldBlock:
            admitted = False
        assert (await manager.get_result(rid)) is not None
        if admitted:
            assert (await manager.get_result("other")) is not None
    assert admitted, "WouldBlock: the two cancelled samples still hold their places in the queue"


# A request of n samples cancelled before they forked used to queue every sample not yet
# cancelled as a request of its own (past the first 64 they end in later loop turns):
# each counted its whole prompt against max_queued_tokens, and a step could compute
# prompts of samples about to end. Its first live sample now computes it for the rest.


async def test_samples_cancelled_before_their_fork_queue_one_prompt_while_they_end(model: PreTrainedModel) -> None:
    prompt, other = random_prompts(2, 40, 40, seed=11)
    config = aiocb.ContinuousBatchingConfig(page_size=16, max_queued_tokens=80)
    async with aiocb.Manager(model, continuous_batching_config=config) as manager:
        rid = await manager.add_request(prompt, max_new_tokens=4, n=100)  # (no step has run yet)
        assert manager.cancel_request(rid)  # it and 64 samples now, 35 in the loop turns that follow
        try:  # one sample's prompt is queued (40 tokens): there is room for 40 more
            manager.add_request_nowait(other, request_id="other", max_new_tokens=4)
            admitted = True
        except aiocb.WouldBlock:
            admitted = False
        if admitted:
            result = await manager.get_result("other")
            assert result is not None and result.generated_tokens == reference_generate(model, other, 4)
        assert (await manager.get_result(f"{rid}__child#98")).status == aiocb.RequestStatus.CANCELLED
    assert admitted, "WouldBlock: the samples still queued count 35 prompts against max_queued_tokens"
