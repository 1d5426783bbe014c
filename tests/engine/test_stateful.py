"""Property-based stateful test: random interleavings of the Manager's public operations.

Hypothesis draws a manager configuration and a list of operations (add one to four
requests through ``generate`` tasks, ``add_request(s)``, or ``add_request(s)`` + ``stream``;
cancel by id or through the consumer; consume results; read streams; graceful stop, hard
stop, restart; settle; small sleeps); each example executes them in order inside one ``asyncio.run``, against
the session's tiny Qwen3. Some configurations have so few, so small blocks that requests
get preempted and recomputed; some chunk prefills; some bound the admission queue.

Checked while running:

* ``cancel_request`` returning True takes the request out of the scheduler at once, and
  a second call returns False;
* when the manager is stopped (after ``stop()``, and after a *settle* that consumed
  everything) it is idle: no running or waiting request, ``free_blocks == total_blocks``;
* every awaiter of ``generate`` is released by ``stop()``; adding to a stopped manager
  raises :class:`aiocb.ManagerClosedError`;
* every output carries every token so far: partial outputs grow, then one final output.

Checked per request at the end of each example: it was reported ended exactly once,
through exactly one channel (a final output, ``RequestAbortedError`` after a hard stop,
``CancelledError`` of its cancelled task, or the stream we closed ourselves), and the
terminal status fits what the operations did to it: ``FINISHED`` (``length``, exactly
``max_new_tokens`` tokens, EOS being disabled) unless a cancel or a hard stop raced it;
``CANCELLED`` only after a cancel and ``FAILED`` only after a hard stop, each with fewer
tokens than asked for. Greedy requests' tokens are (a prefix of, when cut short)
``reference_generate``; seeded sampled requests agree with every other run of the same
prompt and seed, whatever else shared their batches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from hypothesis import HealthCheck, event, given
from hypothesis import strategies as st
from transformers import PreTrainedModel

import aiocb
from tests.conftest import random_prompts, reference_generate
from tests.fuzzing import fuzz_settings

#: Prompts are prefixes of these, so requests share prefixes (prefix-cache hits).
BASE_PROMPTS = random_prompts(6, 40, 40, seed=23)
MAX_NEW = 12
#: An example that is still running after this long has hung.
HANG_TIMEOUT_S = 30.0
#: Cleanup after a failure gets this long before it is abandoned.
CLEANUP_TIMEOUT_S = 10.0

Kind = Literal["generate", "results", "stream"]

# ----------------------------------------------------------------------------- operations


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of a sampled request (``seed=None``: the manager picks one)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int | None


@dataclass(frozen=True)
class Add:
    """Add a request consumed by a ``generate`` task, the results queue, or a stream."""

    kind: Kind
    base: int
    length: int
    max_new_tokens: int
    sampling: Sampling | None
    streaming: bool  # partial outputs through get_result (kind "results" only)
    copies: int = 1  # requests added at once (add_requests for "results" and "stream")


@dataclass(frozen=True)
class Cancel:
    """Cancel a live request by id, or through its consumer (task cancel / stream close)."""

    target: int
    via_consumer: bool


@dataclass(frozen=True)
class Consume:
    """Await up to ``count`` outputs of the results queue, or ``generate`` tasks."""

    what: Literal["results", "generate"]
    target: int
    count: int


@dataclass(frozen=True)
class ReadStream:
    """Read up to ``count`` chunks of one open stream."""

    target: int
    count: int


@dataclass(frozen=True)
class Stop:
    """``await stop()``, graceful or hard, and maybe ``start()`` again at once."""

    hard: bool
    restart: bool = False


@dataclass(frozen=True)
class Start:
    """``start()`` (again): a new session after a stop, a logged no-op while running."""


@dataclass(frozen=True)
class Settle:
    """Consume everything outstanding, then check that the running manager is idle."""


@dataclass(frozen=True)
class Sleep:
    """Let the step loop run a little (0 s is one trip through the event loop)."""

    seconds: float


Op = Add | Cancel | Consume | ReadStream | Stop | Start | Settle | Sleep


@dataclass(frozen=True)
class Setup:
    """The manager's configuration for one example."""

    page_size: int
    num_blocks: int
    max_batch_tokens: int
    scheduler_type: Literal["fifo", "prefill_first"]
    block_sharing: bool
    safety_margin: float | None
    max_queue_size: int
    results_by_id: bool  # consume add_request results with get_result(id), else get_result()

    def config(self) -> aiocb.ContinuousBatchingConfig:
        return aiocb.ContinuousBatchingConfig(
            page_size=self.page_size,
            num_blocks=self.num_blocks,
            max_batch_tokens=self.max_batch_tokens,
            scheduler_type=self.scheduler_type,
            allow_block_sharing=self.block_sharing,
            safety_margin=self.safety_margin,
            max_queue_size=self.max_queue_size,
        )


# 40 + 12 = 52 tokens: the tight caches hold the longest request alone (13 x 4 = 52),
# so a few concurrent requests force preemptions.
_CACHES = st.sampled_from([(4, 13), (4, 13), (4, 16), (8, 8), (16, 48)])
setups = st.builds(
    lambda cache, **kw: Setup(page_size=cache[0], num_blocks=cache[1], **kw),
    cache=_CACHES,
    max_batch_tokens=st.sampled_from([16, 64, 256]),
    scheduler_type=st.sampled_from(["fifo", "prefill_first"]),
    block_sharing=st.booleans(),
    safety_margin=st.sampled_from([None, 0.0]),
    max_queue_size=st.sampled_from([0, 0, 3]),
    results_by_id=st.booleans(),
)
samplings = st.builds(
    Sampling,
    temperature=st.sampled_from([0.7, 1.3]),
    top_k=st.sampled_from([0, 20]),
    top_p=st.sampled_from([1.0, 0.9]),
    seed=st.sampled_from([None, 1, 2]),
)


def _adds() -> st.SearchStrategy[Add]:
    return st.builds(
        Add,
        kind=st.sampled_from(["generate", "results", "stream"]),
        base=st.integers(0, len(BASE_PROMPTS) - 1),
        length=st.integers(1, 40),
        max_new_tokens=st.integers(1, MAX_NEW),
        sampling=st.none() | samplings,
        streaming=st.booleans(),
        copies=st.integers(1, 4),
    )


# one_of counts a repeated (identical) strategy once: the weights are distinct, equivalent strategies.
ops = st.one_of(
    *[_adds() for _ in range(6)],
    *[st.builds(Cancel, target=st.integers(0, 15 + i), via_consumer=st.booleans()) for i in range(2)],
    st.builds(
        Consume, what=st.sampled_from(["results", "generate"]), target=st.integers(0, 15), count=st.integers(1, 3)
    ),
    st.builds(ReadStream, target=st.integers(0, 15), count=st.integers(1, 4)),
    st.builds(Stop, hard=st.booleans(), restart=st.booleans()),
    st.just(Start()),
    st.just(Settle()),
    *[st.builds(Sleep, seconds=st.sampled_from([0.0, 0.0, 0.001, 0.005, 0.02 + i])) for i in (0, 0.001)],
)

# ----------------------------------------------------------------------------- bookkeeping


@dataclass(eq=False)
class Tracked:
    """What the test did to one request and everything its consumers saw."""

    rid: str
    kind: Kind
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling | None
    streaming: bool
    task: asyncio.Task[aiocb.GenerationOutput] | None = None
    stream: aiocb.RequestStream | None = None
    accepted: bool = True  # False once the manager refused it (ManagerClosedError)
    refusal_allowed: bool = False  # a stop happened between creating and resolving it
    cancel_attempted: bool = False
    cancel_request_true: bool = False  # cancel_request() returned True
    maybe_aborted: bool = False  # it had not ended for sure when a hard stop happened
    closed_by_us: bool = False  # we closed its stream before its final chunk
    outputs: list[aiocb.GenerationOutput] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    @property
    def finals(self) -> list[aiocb.GenerationOutput]:
        return [o for o in self.outputs if o.is_finished()]

    @property
    def ended(self) -> bool:
        """Whether a consumer has seen (or caused) its end."""
        return bool(self.finals or self.errors or self.closed_by_us or not self.accepted)

    def record(self, output: aiocb.GenerationOutput) -> None:
        assert output.request_id == self.rid, (output.request_id, self.rid)
        assert output.prompt_ids == self.prompt
        assert not self.finals, f"{self.rid}: an output after its final one: {output}"
        if self.outputs:
            previous = self.outputs[-1].generated_tokens
            assert output.generated_tokens[: len(previous)] == previous, f"{self.rid}: outputs do not extend"
            assert len(output.generated_tokens) > len(previous) or output.is_finished(), f"{self.rid}: empty news"
        self.outputs.append(output)


class Scenario:
    """Executes one example's operations on one manager and keeps the books."""

    def __init__(self, manager: aiocb.Manager, setup: Setup) -> None:
        self.manager = manager
        self.setup = setup
        self.tracked: list[Tracked] = []
        self.by_id: dict[str, Tracked] = {}
        self.preemptions = 0
        self.log: list[str] = []

    # -- helpers

    def _live(self, kinds: Sequence[Kind] = ("generate", "results", "stream")) -> list[Tracked]:
        return [t for t in self.tracked if t.kind in kinds and t.accepted and not t.ended and not t.cancel_attempted]

    def _harvest(self) -> None:
        """Record the outcome of every finished generate task."""
        for t in self.tracked:
            task = t.task
            if task is None or not task.done() or t.ended:
                continue
            if task.cancelled():
                t.errors.append(asyncio.CancelledError())
                continue
            error = task.exception()
            if isinstance(error, aiocb.EngineDeadError):
                raise AssertionError(f"{t.rid}: the step loop died: {error.cause!r}") from None
            if isinstance(error, aiocb.ManagerClosedError):
                assert t.refusal_allowed, f"{t.rid}: refused although the manager was running: {error}"
                t.accepted = False
            elif error is not None:
                t.errors.append(error)
            else:
                t.record(task.result())

    def _record_shared(self, output: aiocb.GenerationOutput) -> None:
        assert output.request_id in self.by_id, f"an output for an id nobody added: {output.request_id}"
        t = self.by_id[output.request_id]
        assert t.kind == "results", f"{t.rid} ({t.kind}) came out of the shared results"
        if not t.streaming:
            assert output.is_finished(), f"{t.rid}: a partial output without streaming=True"
        t.record(output)

    def _load(self) -> int:
        stats = self.manager.statistics()
        return stats.running_requests + stats.waiting_requests

    def check_idle(self, where: str) -> None:
        stats = self.manager.statistics()
        assert stats.running_requests == 0, f"{where}: {stats}"
        assert stats.waiting_requests == 0, f"{where}: {stats}"
        assert stats.free_blocks == stats.total_blocks, f"{where}: blocks leaked: {stats}"

    def check_stats(self) -> None:
        stats = self.manager.statistics()
        assert 0 <= stats.free_blocks <= stats.total_blocks, stats
        if stats.total_blocks:
            assert stats.total_blocks == self.setup.num_blocks, stats
        assert stats.running_requests + stats.waiting_requests <= sum(
            1 for t in self.tracked if t.accepted and not t.ended
        ), stats
        self.preemptions = max(self.preemptions, stats.preemptions)

    # -- operations

    async def apply(self, op: Op) -> None:
        self.log.append(repr(op))
        match op:
            case Add():
                await self._add(op)
            case Cancel():
                await self._cancel(op)
            case Consume(what="results"):
                await self._consume_results(op.target, op.count)
            case Consume(what="generate"):
                await self._consume_tasks(op.target, op.count)
            case ReadStream():
                live = self._live(["stream"])
                if live:
                    await self._read_stream(live[op.target % len(live)], op.count)
            case Stop():
                await self._stop(op.hard)
                if op.restart:
                    self.manager.start()
                    assert self.manager.is_running
            case Start():
                self.manager.start()
                assert self.manager.is_running
            case Settle():
                await self.settle()
                if self.manager.is_running:
                    await asyncio.sleep(0)
                    self.check_idle("settled while running")
            case Sleep():
                await asyncio.sleep(op.seconds)
        self._harvest()
        assert not self.manager.is_dead, f"the step loop died during {op!r}"
        self.check_stats()
        if not self.manager.is_running:
            self.check_idle(f"stopped, after {op!r}")

    async def _add(self, op: Add) -> None:
        prompts = [BASE_PROMPTS[(op.base + i) % len(BASE_PROMPTS)][: op.length] for i in range(op.copies)]
        params: dict[str, object] = {}
        if op.sampling is not None:
            s = op.sampling
            params = {"do_sample": True, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}
            if s.seed is not None:
                params["seed"] = s.seed
        running = self.manager.is_running
        streaming = op.streaming and op.kind == "results"

        def track(rid: str, prompt: list[int]) -> Tracked:
            t = Tracked(rid, op.kind, prompt, op.max_new_tokens, op.sampling, streaming, refusal_allowed=not running)
            self.tracked.append(t)
            self.by_id[rid] = t
            return t

        if op.kind == "generate":
            for prompt in prompts:
                t = track(f"r{len(self.tracked)}", prompt)
                coro = self.manager.generate(prompt, max_new_tokens=op.max_new_tokens, request_id=t.rid, **params)
                t.task = asyncio.create_task(coro, name=t.rid)
            return
        try:
            if len(prompts) == 1:
                rid = f"r{len(self.tracked)}"
                kwargs = {"request_id": rid, "max_new_tokens": op.max_new_tokens, "streaming": streaming}
                ids = [await self.manager.add_request(prompts[0], **kwargs, **params)]
                assert ids == [rid]
            else:
                ids = await self.manager.add_requests(
                    prompts, max_new_tokens=op.max_new_tokens, streaming=streaming, **params
                )
        except aiocb.ManagerClosedError:
            assert not running, "add_request(s) refused by a running manager"
            for prompt in prompts:
                track(f"r{len(self.tracked)}", prompt).accepted = False
            return
        assert running, f"{ids}: a stopped manager accepted requests"
        assert len(set(ids)) == len(ids) == len(prompts), ids
        for rid, prompt in zip(ids, prompts, strict=True):
            assert rid not in self.by_id, f"add_requests reused the id {rid}"
            t = track(rid, prompt)
            if op.kind == "stream":
                t.stream = self.manager.stream(rid)

    async def _cancel(self, op: Cancel) -> None:
        live = self._live()
        if not live:
            return
        t = live[op.target % len(live)]
        t.cancel_attempted = True
        if op.via_consumer and t.task is not None:
            t.task.cancel()
        elif op.via_consumer and t.stream is not None:
            await t.stream.aclose()
            t.closed_by_us = True
            assert not self.manager.cancel_request(t.rid), f"{t.rid}: still cancellable after its stream closed"
        elif self.manager.is_running or self.manager.is_dead:
            before = self._load()
            t.cancel_request_true = self.manager.cancel_request(t.rid)
            if t.cancel_request_true:
                assert self._load() == before - 1, f"{t.rid}: cancel_request left it in the scheduler"
            assert not self.manager.cancel_request(t.rid), f"{t.rid}: cancelled twice"
        else:
            # Stopped: everything has ended, so there is nothing to cancel.
            assert not self.manager.cancel_request(t.rid), f"{t.rid}: cancellable on a stopped manager"

    async def _consume_results(self, target: int, count: int) -> None:
        if not self.setup.results_by_id:
            for _ in range(count):
                output = await self.manager.get_result(timeout=0.02)
                if output is None:
                    break
                self._record_shared(output)
            return
        live = [t for t in self.tracked if t.kind == "results" and t.accepted and not t.finals]
        if live:
            t = live[target % len(live)]
            for _ in range(count):
                t.record(await self._result_of(t))
                if t.finals:
                    break

    async def _result_of(self, t: Tracked) -> aiocb.GenerationOutput:
        output = await self.manager.get_result(t.rid)
        assert output is not None
        if not t.streaming:
            assert output.is_finished(), f"{t.rid}: a partial output without streaming=True"
        return output

    async def _consume_tasks(self, target: int, count: int) -> None:
        pending = [t.task for t in self.tracked if t.task is not None and not t.task.done()]
        if pending:
            start = target % len(pending)
            chosen = (pending[start:] + pending[:start])[:count]
            await asyncio.wait(chosen, timeout=0.05)

    async def _read_stream(self, t: Tracked, count: int | None) -> None:
        assert t.stream is not None
        read = 0
        while count is None or read < count:
            read += 1
            try:
                chunk = await t.stream.__anext__()
            except StopAsyncIteration:
                raise AssertionError(f"{t.rid}: the stream stopped without a final chunk") from None
            except aiocb.RequestAbortedError as error:
                t.errors.append(error)
                return
            t.record(chunk)
            if chunk.is_finished():
                try:
                    await t.stream.__anext__()
                except StopAsyncIteration:
                    return
                raise AssertionError(f"{t.rid}: the stream went on after its final chunk")

    async def _stop(self, hard: bool) -> None:
        was_running = self.manager.is_running
        self._harvest()
        for t in self.tracked:
            if not t.ended:
                t.refusal_allowed = True
                t.maybe_aborted = t.maybe_aborted or (hard and was_running)
        await self.manager.stop(hard_stop=hard)
        assert not self.manager.is_running
        self.check_idle("after stop()")
        pending = [t.task for t in self.tracked if t.task is not None and not t.task.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=2.0)
            assert not still, f"generate awaiters not released by stop(): {[t.get_name() for t in still]}"

    async def settle(self) -> None:
        """Consume every outstanding output, so that every request has been seen to end."""
        pending = [t.task for t in self.tracked if t.task is not None and not t.task.done()]
        if pending:
            await asyncio.wait(pending)
        self._harvest()
        for t in self.tracked:
            if t.stream is not None and t.accepted and not t.ended:
                await self._read_stream(t, None)
        waiting = [t for t in self.tracked if t.kind == "results" and t.accepted and not t.finals]
        if self.setup.results_by_id:
            for t in waiting:
                while not t.finals:
                    t.record(await self._result_of(t))
        else:
            while any(not t.finals for t in waiting):
                output = await self.manager.get_result()
                assert output is not None, "get_result() ran dry with results still owed"
                self._record_shared(output)
            extra = await self.manager.get_result(timeout=0.01)
            assert extra is None, f"an output after every request was seen to end: {extra}"


async def _execute(model: PreTrainedModel, setup: Setup, operations: list[Op]) -> Scenario:
    manager = aiocb.Manager(model, continuous_batching_config=setup.config())
    scenario = Scenario(manager, setup)
    manager.start()
    try:
        async with asyncio.timeout(HANG_TIMEOUT_S):
            # A graceful stop, then every output is read: each request must be seen to end.
            for op in [*operations, Stop(hard=False), Settle()]:
                try:
                    await scenario.apply(op)
                except aiocb.EngineDeadError as error:
                    # Shown without its (long) chained traceback.
                    raise AssertionError(f"the step loop died during {op!r}: {error.cause!r}") from None
    except TimeoutError:
        raise AssertionError(f"hung; {manager.statistics()}; operations so far: {scenario.log}") from None
    finally:
        async with asyncio.timeout(CLEANUP_TIMEOUT_S):
            if manager.is_running:
                await manager.stop(hard_stop=True)
            leftovers = [t.task for t in scenario.tracked if t.task is not None and not t.task.done()]
            for task in leftovers:
                task.cancel()
            await asyncio.gather(*leftovers, return_exceptions=True)
            for t in scenario.tracked:  # after a failure: retrieve what nobody harvested
                if t.task is not None and not t.task.cancelled():
                    t.task.exception()
            for t in scenario.tracked:
                if t.stream is not None:
                    await t.stream.aclose()
            await manager.destroy()
    return scenario


# ----------------------------------------------------------------------------- final checks

_greedy_refs: dict[tuple[int, ...], list[int]] = {}
_sampled_refs: dict[tuple[tuple[int, ...], Sampling], list[int]] = {}


def _greedy_reference(model: PreTrainedModel, prompt: list[int]) -> list[int]:
    """``reference_generate(prompt, MAX_NEW)``; greedy, so shorter runs are its prefixes."""
    key = tuple(prompt)
    if key not in _greedy_refs:
        _greedy_refs[key] = reference_generate(model, prompt, MAX_NEW)
    return _greedy_refs[key]


def _check_tokens(model: PreTrainedModel, t: Tracked, tokens: list[int], complete: bool) -> None:
    """Greedy: a prefix of the reference; seeded sampling: consistent with earlier runs."""
    assert all(0 <= tok < model.config.vocab_size for tok in tokens)
    if t.sampling is None:
        expected = _greedy_reference(model, t.prompt)[: t.max_new_tokens]
        if complete:
            assert tokens == expected, f"{t.rid}: greedy tokens differ from model.generate"
        else:
            assert tokens == expected[: len(tokens)], f"{t.rid}: greedy prefix differs from model.generate"
    elif t.sampling.seed is not None:
        key = (tuple(t.prompt), t.sampling)
        known = _sampled_refs.setdefault(key, tokens)
        shorter = min(len(known), len(tokens))
        assert tokens[:shorter] == known[:shorter], f"{t.rid}: seeded sampling not reproducible: {tokens} vs {known}"
        if len(tokens) > len(known):
            _sampled_refs[key] = tokens


def _check_request(model: PreTrainedModel, t: Tracked) -> None:
    if not t.accepted:
        assert not t.outputs, f"{t.rid}: refused, yet it produced outputs"
        assert not t.errors, f"{t.rid}: refused, yet it raised {t.errors!r}"
        return
    finals = t.finals
    endings = len(finals) + len(t.errors) + int(t.closed_by_us)
    assert endings == 1, f"{t.rid}: seen to end {endings} times: finals={finals} errors={t.errors!r}"
    partial = [o.generated_tokens for o in t.outputs if not o.is_finished()]
    for tokens in partial:
        _check_tokens(model, t, tokens, complete=False)
    if t.errors:
        error = t.errors[0]
        if isinstance(error, asyncio.CancelledError):
            assert t.kind == "generate", f"{t.rid}: a {t.kind} request ended in CancelledError"
            assert t.cancel_attempted, f"{t.rid}: cancelled out of the blue"
        else:
            assert isinstance(error, aiocb.RequestAbortedError), f"{t.rid}: unexpected {error!r}"
            assert t.maybe_aborted, f"{t.rid}: aborted without a hard stop"
            assert t.kind != "results", f"{t.rid}: RequestAbortedError reached a results consumer"
        return
    if t.closed_by_us:
        assert t.kind == "stream"
        assert t.cancel_attempted
        return
    final = finals[0]
    tokens = final.generated_tokens
    assert final.finished_time is not None
    if final.status is aiocb.RequestStatus.FINISHED:
        assert not t.cancel_request_true, f"{t.rid}: cancel_request() returned True, yet it finished"
        assert final.finish_reason is aiocb.FinishReason.LENGTH, final
        assert len(tokens) == t.max_new_tokens, final
        _check_tokens(model, t, tokens, complete=True)
    elif final.status is aiocb.RequestStatus.CANCELLED:
        assert t.cancel_attempted, f"{t.rid}: cancelled without a cancel"
        assert final.finish_reason is aiocb.FinishReason.CANCELLED, final
        assert len(tokens) < t.max_new_tokens, final
        _check_tokens(model, t, tokens, complete=False)
    elif final.status is aiocb.RequestStatus.FAILED:
        assert t.maybe_aborted, f"{t.rid}: failed without a hard stop: {final}"
        assert not t.cancel_request_true, f"{t.rid}: cancel_request() returned True, yet it was aborted"
        assert final.finish_reason is aiocb.FinishReason.ABORTED, final
        assert final.error, final
        assert len(tokens) < t.max_new_tokens, final
        _check_tokens(model, t, tokens, complete=False)
    else:
        raise AssertionError(f"{t.rid}: a final output with status {final.status!r}")


@fuzz_settings(25, suppress=(HealthCheck.data_too_large,))
@given(setup=setups, operations=st.lists(ops, min_size=10, max_size=40))
def test_random_operation_sequences_keep_the_invariants(
    qwen3: PreTrainedModel, setup: Setup, operations: list[Op]
) -> None:
    scenario = asyncio.run(_execute(qwen3, setup, operations))
    # model.generate runs only now: the manager is destroyed and the model has its attention back.
    for t in scenario.tracked:
        _check_request(qwen3, t)
    event(f"preempted: {scenario.preemptions > 0}")
    event(f"hard stop: {any(isinstance(op, Stop) and op.hard for op in operations)}")
    endings = {o.status.name for t in scenario.tracked for o in t.finals}
    endings |= {type(e).__name__ for t in scenario.tracked for e in t.errors}
    endings |= {"closed" for t in scenario.tracked if t.closed_by_us}
    endings |= {"refused" for t in scenario.tracked if not t.accepted}
    for name in sorted(endings):
        event(f"ending seen: {name}")
    event(f"requests: {len(scenario.tracked) // 5 * 5}+")
