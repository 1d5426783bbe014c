"""The public asyncio manager: lifecycle, and the request API over its parts.

A :class:`Manager` is a facade. A :class:`~aiocb.engine.requests.RequestFactory` checks
and builds requests, an :class:`~aiocb.engine.admission.AdmissionQueue` applies
backpressure, the :class:`~aiocb.engine.step_loop.StepLoop` runs the steps and an
:class:`~aiocb.engine.router.OutputRouter` takes each request's outputs to its awaiter,
its stream or the shared results. The manager itself starts, stops and fails them.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import copy
import enum
import logging
import math
import threading
import time
import traceback
import types
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from aiocb.collector import freeze_alive_objects
from aiocb.config import ContinuousBatchingConfig, WorkloadHints, as_config
from aiocb.core.kv_cache import KVCacheManager, ring_safe_tokens
from aiocb.core.request import Request
from aiocb.core.scheduler import Scheduler
from aiocb.engine.admission import AdmissionQueue, Turnstile
from aiocb.engine.requests import CheckedRequest, RequestFactory, has_large_controls
from aiocb.engine.router import OutputRouter
from aiocb.engine.step_loop import StepLoop
from aiocb.engine.stream import Consumer, RequestHandle, RequestStream
from aiocb.engine.turns import LoopTurn, each_in_turns, release, sorted_in_turns
from aiocb.errors import (
    EngineDeadError,
    InvalidConfigError,
    InvalidRequestError,
    ManagerClosedError,
    WouldBlock,
    WrongEventLoopError,
)
from aiocb.gil import pausing_call, yield_gil
from aiocb.outputs import FinishReason, GenerationOutput, RequestStatus
from aiocb.params import STRUCTURE_FIELDS, SamplingParams, asks_for_structure
from aiocb.prompts import Prompt, check_prompt_list, is_large
from aiocb.runner.distributed import build_runner, driver_layout, tensor_parallel_layout
from aiocb.runner.memory import CachePlan, memory_percent, scored_rows
from aiocb.runner.model_runner import ModelRunner, runner_plan
from aiocb.runner.model_spec import ModelSpec, served_context
from aiocb.sampling import RequestLimits, eos_ids, is_long_id_prompt, merged_generation_config
from aiocb.speculative import SpeculativeConfig, draft_share, load_draft_model

logger = logging.getLogger(__name__)

_CACHED_MANAGER_ATTR = "_aiocb_persistent_manager"
#: what a session's task raises again once every waiter has its end (the event loop's to act on)
_INTERRUPTS = (KeyboardInterrupt, SystemExit)


class _State(enum.Enum):
    CREATED = "created"
    #: under tensor parallelism, while start() reaches the other ranks off the loop
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    DEAD = "dead"
    DESTROYED = "destroyed"


@dataclass(frozen=True, slots=True)
class ManagerStatistics:
    """A snapshot of the manager's state and counters."""

    is_running: bool
    running_requests: int
    waiting_requests: int
    free_blocks: int
    total_blocks: int
    cache_usage: float
    steps: int
    tokens_computed: int
    tokens_generated: int
    preemptions: int
    recomputed_tokens: int
    prefix_hit_tokens: int
    offloaded_blocks: int
    restored_blocks: int
    #: speculative decoding: proposed tokens the model verified (those past a stop token
    #: or string, or of a request cancelled while its step ran, never were), and those of
    #: them it agreed with
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    #: the longest sequence the cache holds when it holds nothing else (tokens)
    capacity_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """The share of proposed tokens accepted (None before any was proposed)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else None


#: The token ids of a prompt that :func:`_prefix_key` keys it by.
_PREFIX_KEY_IDS = 8192


def _prefix_key(prompt: list[int]) -> bytes:
    """What orders a batch's prompts so that those sharing a prefix are queued together: their
    first ids' bytes, compared by ``memcmp`` (lists of ids compared one id at a time: 4,096
    prompts behind a 2,000-token system prompt took a second to sort)."""
    return array.array("i", prompt[:_PREFIX_KEY_IDS]).tobytes()


def _check_manager_arguments(
    generation_config: object,
    tokenizer: object,
    grammar_tokenizer: object,
    num_requests_hint: object,
    speculative_config: object,
) -> None:
    """InvalidConfigError naming the first of the manager's arguments of the wrong kind
    (found when made, not at a request's or the start's first use of it)."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise InvalidConfigError(
            f"generation_config must be a transformers GenerationConfig, got {type(generation_config).__name__} "
            "(a ContinuousBatchingConfig goes third, or as continuous_batching_config=)"
        )
    for name, value in (("tokenizer", tokenizer), ("grammar_tokenizer", grammar_tokenizer)):
        if value is not None and not all(callable(getattr(value, m, None)) for m in ("encode", "decode")):
            raise InvalidConfigError(
                f"{name} must be a tokenizer (AutoTokenizer.from_pretrained(...)), got {type(value).__name__}"
            )
    if num_requests_hint is not None and (
        not isinstance(num_requests_hint, int) or isinstance(num_requests_hint, bool) or num_requests_hint < 1
    ):
        raise InvalidConfigError(f"num_requests_hint must be an int of at least 1, got {num_requests_hint!r}")
    if speculative_config is not None and not isinstance(speculative_config, SpeculativeConfig):
        raise InvalidConfigError(
            f"speculative_config must be an aiocb.SpeculativeConfig, got {type(speculative_config).__name__} "
            "(SpeculativeConfig.from_dict() takes a dict of its fields)"
        )


def _check_speculation_fits_rings(config: SpeculativeConfig, spec: ModelSpec, page_size: int) -> None:
    """InvalidConfigError unless speculation suits the model's sliding-window layers: a
    row verifying ``k`` proposals writes ``k + 1`` positions into each sliding layer's ring
    of blocks, and a rejected one must not have overwritten a key still in the window of
    the positions that follow (:func:`~aiocb.core.kv_cache.ring_safe_tokens`). (A draft
    model over a target whose layers all slide is refused where the runner is planned.)"""
    windows = sorted({window for window in spec.layer_windows if window is not None})
    if not windows:
        return
    most = min(ring_safe_tokens(window, page_size) for window in windows) - 1
    if config.num_speculative_tokens is not None and config.num_speculative_tokens > most:
        raise InvalidConfigError(
            f"num_speculative_tokens={config.num_speculative_tokens} is more than the {most} this model's "
            f"sliding windows ({', '.join(map(str, windows))} tokens) take at page_size={page_size}: a rejected "
            "proposal written into a window's ring of blocks would overwrite a key still in the window"
        )


class Manager:
    """Continuous batching for one transformers causal LM, driven by the running event loop.

    One step coroutine on the loop schedules requests, awaits the forward pass (run by a
    worker thread on CPU, so the loop stays free) and delivers tokens to awaiters and
    streams. All state belongs to the loop's thread. Typical use::

        async with aiocb.Manager(model, generation_config=gen_cfg) as manager:
            output = await manager.generate(prompt_ids, max_new_tokens=32)

    ``generation_config`` gives the requests' defaults; as in ``model.generate``, a field
    it leaves unset comes from ``model.generation_config``. ``continuous_batching_config``
    says how the cache and batches are sized (:class:`~aiocb.ContinuousBatchingConfig`, or
    transformers' own, taken field by field; one carried by ``generation_config`` is taken
    too, with transformers' deprecation warning).
    With ``tokenizer`` prompts may be texts or chat messages and outputs carry text;
    ``grammar_tokenizer`` gives the vocabulary that output constraints are compiled against
    when prompts stay token ids (``tokenizer``'s, when given). ``workload_hints``
    (:class:`~aiocb.WorkloadHints`, or transformers' own) say the longest request and how
    many come at once, to size the decode block table and the batch by;
    ``num_requests_hint`` says the latter alone (and wins). ``speculative_config`` makes
    requests speculate (:class:`~aiocb.SpeculativeConfig`).

    Leaving the ``async with`` block normally stops the manager gracefully (requests still
    queued or running finish); leaving it by an exception or a cancellation aborts them
    (``stop(hard_stop=True)``: nobody is left to read them), where transformers' context
    manager finishes them.

    With ``persistent_manager=True`` the manager outlives its ``async with`` block: the
    next ``aiocb.Manager(model, persistent_manager=True)`` on the same model returns the
    same manager (and its cache), even under a new event loop; given another configuration
    it raises :class:`~aiocb.InvalidConfigError` naming what differs (transformers'
    ``generate_batch`` takes a new generation config's ``max_new_tokens`` then, and ignores
    its other fields; here a request's own parameters are the way to change them). Its
    cache and batches keep the sizes the first hints gave (a ``num_requests_hint`` other
    than that one, or other ``workload_hints``, are warned of).
    """

    config: ContinuousBatchingConfig

    def __new__(cls, model: PreTrainedModel, *args: Any, persistent_manager: bool = False, **kwargs: Any) -> Manager:
        cached = cls.persistent_manager_of(model)
        if persistent_manager and isinstance(cached, cls):
            return cached
        # Before the manager exists, so that it (and the runner and cache it will build)
        # stays out of the frozen set; see _freeze_the_first_managers_model.
        _freeze_the_first_managers_model()
        return super().__new__(cls)

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        grammar_tokenizer: PreTrainedTokenizerBase | None = None,
        persistent_manager: bool = False,
        num_requests_hint: int | None = None,
        speculative_config: SpeculativeConfig | None = None,
        workload_hints: WorkloadHints | None = None,
    ) -> None:
        if getattr(self, "_initialized", False):
            # A cached persistent manager, returned by __new__: it keeps its configuration.
            _check_manager_arguments(
                generation_config, tokenizer, grammar_tokenizer, num_requests_hint, speculative_config
            )
            self._refuse_another_configuration(
                generation_config, continuous_batching_config, speculative_config, tokenizer, grammar_tokenizer
            )
            if num_requests_hint is not None and num_requests_hint != self._num_requests_hint:
                built = self._num_requests_hint
                logger.warning(
                    "num_requests_hint=%r is not applied: the model's persistent manager was sized %s when it was "
                    "built; destroy it (await manager.destroy()) to size another",
                    num_requests_hint,
                    "without one" if built is None else f"for {built} requests",
                )
            hints = WorkloadHints.of(workload_hints)
            if hints is not None and hints != self._workload_hints:
                logger.warning(
                    "workload_hints=%r are not applied: the model's persistent manager was sized by %r when it was "
                    "built; destroy it (await manager.destroy()) to size another",
                    hints,
                    self._workload_hints,
                )
            return
        _check_manager_arguments(generation_config, tokenizer, grammar_tokenizer, num_requests_hint, speculative_config)
        self._initialized = True
        self.model = model
        self.generation_config = merged_generation_config(model, generation_config)
        carrier = generation_config if generation_config is not None else model.generation_config
        self.config = as_config(continuous_batching_config, carrier)
        #: the longest sequence a request may reach: the model's context length, or the
        #: config's ``max_model_len``
        self.max_model_len = served_context(model.config.get_text_config(), self.config.max_model_len)
        #: with a tokenizer, prompts may be text or chat messages and outputs carry text
        self.tokenizer = tokenizer
        model_eos = eos_ids(getattr(model.config.get_text_config(), "eos_token_id", None))
        # A manager in token ids (a server doing its own text) may still constrain outputs:
        # ``grammar_tokenizer`` gives the vocabulary (``tokenizer`` does, when given).
        self._requests = RequestFactory(
            self.generation_config, self.config, tokenizer, model_eos, grammar_tokenizer=grammar_tokenizer
        )
        self.persistent = persistent_manager
        #: how requests speculate (None: they do not; see :mod:`aiocb.speculative`)
        self.speculative_config = speculative_config
        #: its draft model (``method="draft"``), loaded here rather than on the event loop
        self._draft_model = load_draft_model(speculative_config, model)
        hints = WorkloadHints.of(workload_hints)
        #: the hints it was sized by (a persistent manager's reuse warns of others)
        self._workload_hints: WorkloadHints | None = hints
        #: what the runner is built with: :attr:`config` sized by the hints
        self._runner_config = self.config.sized_for(hints, self.max_model_len)
        if num_requests_hint is None and hints is not None and hints.num_requests:
            num_requests_hint = hints.num_requests
        self._num_requests_hint: int | None = num_requests_hint
        self._state = _State.CREATED
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        #: a stop begun with block=False, which goes on without its caller
        self._stopping: asyncio.Future[None] | None = None
        #: the destroy after the stop of a cancelled ``async with`` entry (kept: see _stopping)
        self._leaving: asyncio.Future[None] | None = None
        #: the outcome of the last start under tensor parallelism (None: none yet)
        self._starting: asyncio.Future[None] | None = None
        #: sessions begun (started, or failed to start), and the last start's failure
        self._sessions = 0
        self._start_failure: BaseException | None = None
        #: the state whose refusals of requests were logged (one line, not one per caller)
        self._refusals_logged: _State | None = None
        self._runner: ModelRunner | None = None
        #: on one process, the layout and cache plan of the session's runner, known before
        #: the runner is built off the loop (see :meth:`_make_steps`)
        self._layout: tuple[ModelSpec, CachePlan] | None = None
        #: the runner being built and attached on a worker thread for the session starting
        self._pending_build: _Build | None = None
        #: one abandoned with its closed loop, maybe still running: the next build waits for it
        self._abandoned_build: _Build | None = None
        self._steps: StepLoop | None = None
        #: the timers that end those with a timeout at their deadline
        self._deadline_timers: list[asyncio.TimerHandle] = []
        #: the last statistics, kept when destroy() drops the step loop and its scheduler
        self._final_statistics: ManagerStatistics | None = None
        self._dead_error: EngineDeadError | None = None
        self._admission = AdmissionQueue(self.config.max_queue_size, self.config.max_queued_tokens)
        self._router = OutputRouter(on_room=self._admission.release)
        self._turnstile = Turnstile()
        #: the ``async with`` blocks inside the manager now: the last one out stops it
        self._blocks = 0
        if persistent_manager:
            setattr(model, _CACHED_MANAGER_ATTR, self)

    def _refuse_another_configuration(
        self,
        generation_config: GenerationConfig | None,
        continuous_batching_config: ContinuousBatchingConfig | None,
        speculative_config: SpeculativeConfig | None,
        tokenizer: PreTrainedTokenizerBase | None,
        grammar_tokenizer: PreTrainedTokenizerBase | None,
    ) -> None:
        """InvalidConfigError naming what differs from this (persistent) manager's own
        configuration; ``num_requests_hint`` sizes a cache that exists already."""
        given_generation = (
            None if generation_config is None else merged_generation_config(self.model, generation_config)
        )
        differs = {
            "continuous_batching_config": continuous_batching_config is not None
            and as_config(continuous_batching_config) != self.config,
            "speculative_config": speculative_config not in (None, self.speculative_config),
            "generation_config": given_generation not in (None, self.generation_config),
            "tokenizer": tokenizer is not None and tokenizer is not self.tokenizer,
            "grammar_tokenizer": grammar_tokenizer is not None
            and grammar_tokenizer is not self._requests.grammar_tokenizer,
        }
        changed = [name for name, differ in differs.items() if differ]
        if changed:
            raise InvalidConfigError(
                f"the model's persistent manager was built with another {' and '.join(changed)}; "
                "destroy it (await manager.destroy()) to build one with the new configuration"
            )

    # ------------------------------------------------------------------ lifecycle

    @property
    def continuous_batching_config(self) -> ContinuousBatchingConfig:
        """:attr:`config` with what this manager chose filled in, as transformers' manager
        shows it, once its cache is planned (at the first request or start; before,
        :attr:`config`): ``num_blocks`` (blocks of the whole model costing what its cache
        groups' blocks cost: given back, it fits the same memory), ``max_batch_tokens``,
        ``max_requests_per_batch``, ``max_memory_percent``, ``max_blocks_per_request`` (the
        block tables' width in the decode graphs and the in-place kernels), and once the
        runner is built (:meth:`wait_started`) ``use_cuda_graph`` (``(varlen, decode)``) and
        ``use_async_batching``."""
        runner = self._runner
        layout = (runner.spec, runner.plan) if runner is not None else self._layout
        if layout is None:
            return self.config
        spec, plan = layout
        resolved = copy.copy(self._runner_config)  # (not replace(): no checks or deprecation warnings again)
        # (a num_blocks given is every group's: a hybrid model's sliding groups hold fewer)
        per_block = spec.group_block_bytes(plan.page_size)
        resolved.num_blocks = sum(n * b for n, b in zip(plan.num_blocks, per_block, strict=True)) // sum(per_block)
        resolved.max_batch_tokens = plan.max_batch_tokens
        resolved.max_requests_per_batch = plan.max_requests_per_batch
        resolved.max_memory_percent = memory_percent(self.config, spec.device)
        if resolved.max_blocks_per_request is None:
            resolved.max_blocks_per_request = resolved.fallback_max_blocks_per_request
        if runner is not None:
            resolved.use_cuda_graph = (False, runner.graphs is not None)
            resolved.use_async_batching = runner.async_batching
        return resolved

    @property
    def is_running(self) -> bool:
        """Whether the step loop runs (also while it starts, and while stopping gracefully)."""
        self._forget_a_closed_loop()
        return self._state in (_State.STARTING, _State.RUNNING, _State.STOPPING)

    @property
    def is_dead(self) -> bool:
        """Whether the step loop failed; only :meth:`destroy` is left to do."""
        return self._state is _State.DEAD

    def start(self) -> None:
        """Start the step loop on the running event loop.

        The model runner (its KV cache allocated: a second or more for a large cache) is
        built on a worker thread, so ``start()`` returns at once: requests are taken from
        then on, checked against the cache plan made here, and wait in the queue until the
        runner is ready. :meth:`wait_started` waits for it and raises what made it fail; the
        requests made meanwhile (or before it) are then aborted, or refused if still being
        made, naming it, and the manager is as it was before the start (it may be started
        again). A cache plan that cannot be made (no cache fits the memory budget) raises
        here.

        Requests made before the first start (on one process) wait in the queue for it, as
        transformers' do; they are checked when made, and the start must come on their
        event loop. :meth:`stop` before the start aborts them.

        Under tensor parallelism building the cache and starting the session are round
        trips to the other ranks, which agree on the plan: requests made before they are
        done wait for them (``add_request_nowait`` refuses them).
        """
        if self._state is _State.DESTROYED:
            raise ManagerClosedError("this manager was destroyed and cannot be restarted; create a new Manager")
        if self._state is _State.DEAD:
            raise self._dead()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "Manager.start() needs a running event loop: call it from async code, or use "
                "`async with aiocb.Manager(...)`; for blocking use, call aiocb.generate_batch()"
            ) from None
        self._forget_a_closed_loop()
        if self._state is _State.STOPPING:
            raise ManagerClosedError("the manager is still stopping: await its stop() before start() again")
        if self._state is _State.CREATED and self._loop is not None and loop is not self._loop:
            raise self._wrong_loop()  # (requests queued before the start wait on their loop)
        if self.is_running:
            if loop is not self._loop:
                raise self._wrong_loop()
            logger.warning("Manager.start(): the manager is already running")
            return
        self._refusals_logged = None
        if driver_layout(self.model, self._draft_model) is not None:
            self._starting = loop.create_future()
            self._bind(loop, _State.STARTING, self._start_then_run(self._state, self._starting))
            return
        previous = self._state
        steps = self._steps if self._queued_before_start else self._make_steps()
        assert steps is not None
        self._starting = loop.create_future()
        self._bind(loop, _State.RUNNING, self._attach_then_run(previous, steps, self._starting))

    async def wait_started(self) -> None:
        """Wait until the session :meth:`start` began has started; raises what made it fail.

        ``start()`` returns before its runner is built (on a worker thread): this waits for
        it. Under tensor parallelism ``start()`` returns before the other ranks are reached,
        and this waits for them too: it raises what made the start fail (another manager's
        session runs on the ranks, no cache fits, a rank does not answer), as the requests
        made meanwhile do.
        """
        self._check_loop()
        if self._starting is not None:
            await asyncio.shield(self._starting)

    def _attached_runner(self, runner: ModelRunner | None) -> ModelRunner:
        """``runner``, or a new one on first use (the cache is allocated), attached to the
        model for a session; detached again if attaching fails."""
        if runner is None:
            runner = self._new_runner()
        try:
            runner.attach()
        except BaseException:
            runner.detach()
            raise
        return runner

    def _new_runner(self) -> ModelRunner:
        """A runner for this manager's model (its KV cache allocated), not attached; on one
        process, with the plan its session's requests were checked against."""
        return build_runner(
            self.model,
            self._runner_config,
            num_requests_hint=self._num_requests_hint,
            keep_cache=self.persistent,
            draft_model=self._draft_model,
            speculative=self.speculative_config,
            plan=None if self._layout is None else self._layout[1],
        )

    @property
    def _queued_before_start(self) -> bool:
        """Whether requests were made before the first start: they wait in ``_steps``'s
        queue, bound to the loop they were made on (a manager never started has no other)."""
        return self._state is _State.CREATED and self._loop is not None

    def _make_steps(self) -> StepLoop:
        """The scheduler and step loop of a session on one process, made on the event loop
        from the runner's plan (a persistent manager's runner's, or a new one) before the
        runner is built (or attached) off it: requests are checked against them, and wait
        in the scheduler's queue, meanwhile. Raises where no plan or scheduler can be made."""
        if self._runner is not None:
            layout = (self._runner.spec, self._runner.plan)
        else:
            layout = runner_plan(
                self.model,
                self._runner_config,
                num_requests_hint=self._num_requests_hint,
                draft_model=self._draft_model,
                speculative=self.speculative_config,
            )
        scheduler = self._scheduler(*layout)
        self._layout = layout
        self._steps = StepLoop(scheduler, self._runner, self._router.on_step)
        self._admission.scheduler = scheduler
        self._router.steps = self._steps
        return self._steps

    def _expire_before_start(self) -> None:
        """A deadline of a request queued before the steps run (before the start, or while
        the runner is built) came: end those it ends."""
        if self._steps is not None and self._steps.runner is None and self._state is not _State.DEAD:
            self._steps.expire_some()  # (a timer's callback: the queue before the start, at once)
            now = asyncio.get_running_loop().time()
            self._deadline_timers = [timer for timer in self._deadline_timers if timer.when() > now]

    def _stop_deadline_timers(self) -> None:
        for timer in self._deadline_timers:
            timer.cancel()
        self._deadline_timers.clear()

    async def _start_then_run(self, previous: _State, starting: asyncio.Future[None]) -> None:
        """The session's task under tensor parallelism: the runner is built and attached on a
        worker thread, as both wait for the other ranks (up to ``cpu_group_timeout``), then
        the steps run. A failed start leaves the manager as it was (``previous``)."""
        try:
            steps = self._open_session(await self._attached_off_the_loop())
        except asyncio.CancelledError:
            self._not_started(
                previous, starting, ManagerClosedError("the event loop shut down while the manager started")
            )
            raise
        except GeneratorExit:  # (the coroutine closed with its loop: nothing of the model's)
            raise
        except BaseException as exc:  # (a BaseException of the model's too: every waiter must hear)
            self._not_started(previous, starting, exc)
            if isinstance(exc, _INTERRUPTS):
                raise
            return
        self._state = _State.RUNNING
        starting.set_result(None)
        await self._run_steps(steps)

    async def _attach_then_run(self, previous: _State, steps: StepLoop, starting: asyncio.Future[None]) -> None:
        """The session's task on one process: the runner built (its cache allocated; a
        persistent manager's is kept) and attached on a worker thread, then the steps run.
        A runner that cannot be built ends the session before it began: what was queued is
        aborted, and the manager is as it was (``previous``)."""
        try:
            runner = await self._attached_off_the_loop()
        except asyncio.CancelledError:
            self._stop_deadline_timers()
            self._router.abort_all("the event loop running the manager shut down")
            starting.set_exception(ManagerClosedError("the event loop shut down while the manager started"))
            starting.exception()  # (retrieved: nobody has to wait for the start)
            self._end_session()
            raise
        except GeneratorExit:  # (the coroutine closed with its loop: nothing of the model's)
            raise
        except BaseException as exc:  # (a BaseException of the model's too: every waiter must hear)
            assert self._steps is steps
            self._drop_queue(f"the manager's start failed (building the model runner and its KV cache: {exc!r})")
            if self._runner is None:
                self._layout = None  # (the next start plans anew)
            self._not_started(previous, starting, exc)
            if isinstance(exc, _INTERRUPTS):
                raise
            return
        self._stop_deadline_timers()  # (the step loop ends those requests from now on)
        self._runner = runner
        steps.runner = runner
        starting.set_result(None)
        await self._run_steps(steps)

    async def _attached_off_the_loop(self) -> ModelRunner:
        """:meth:`_attached_runner` on a worker thread (under tensor parallelism: a round trip
        to the other ranks); if the loop closes meanwhile, the runner is detached as soon as
        it is attached (see :meth:`_forget_a_closed_loop`)."""
        build = self._pending_build = _Build(after=self._abandoned_build)
        self._abandoned_build = None
        work = asyncio.get_running_loop().run_in_executor(None, build.run, self._attached_runner, self._runner)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # The worker thread cannot be interrupted: wait for it, and end the session it
            # started, or the other ranks would stay attached to a runner nobody stops.
            await asyncio.wait([work])
            if not work.cancelled() and work.exception() is None:
                self._end_runner_session(work.result())
            raise
        finally:
            self._pending_build = None  # (collected, or ended: it must not keep the runner)

    def _not_started(self, previous: _State, starting: asyncio.Future[None], error: BaseException) -> None:
        """A start off the loop failed: the manager is as it was (stopped, if a stop came
        meanwhile), and whoever waits for the start (:meth:`wait_started`, requests) gets
        ``error``."""
        logger.error("Manager.start() failed: %s", error)
        self._start_failure = error
        self._state = _State.STOPPED if self._state is _State.STOPPING else previous
        self._loop = None
        self._task = None
        self._router.results_changed.set()
        starting.set_exception(error)
        starting.exception()  # (retrieved: nobody has to wait for the start)

    async def _until_started(self) -> None:
        """Wait while a start off the loop is under way (raises its failure)."""
        if self._state is _State.STARTING:
            assert self._starting is not None
            await asyncio.shield(self._starting)

    def _open_session(self, runner: ModelRunner) -> StepLoop:
        """The scheduler and step loop of a session under tensor parallelism on ``runner``
        (attached); it is detached if they cannot be made."""
        self._runner = runner
        try:
            scheduler = self._scheduler(runner.spec, runner.plan)
        except BaseException:
            self._end_runner_session(runner)
            raise
        self._steps = StepLoop(scheduler, runner, self._router.on_step)
        self._admission.scheduler = scheduler
        self._router.steps = self._steps
        return self._steps

    def _scheduler(self, spec: ModelSpec, plan: CachePlan) -> Scheduler:
        groups = spec.cache_groups(plan.num_blocks, plan.num_host_blocks)
        kv_cache = KVCacheManager(groups, plan.page_size, enable_prefix_caching=self.config.allow_block_sharing)
        if self.config.allow_block_sharing and not kv_cache.prefix_caching:
            logger.info("prefix caching is off: the model has sliding-window layers, which keep no full prefix")
        if self.speculative_config is not None:
            _check_speculation_fits_rings(self.speculative_config, spec, plan.page_size)
        return Scheduler(
            kv_cache,
            max_batch_tokens=plan.max_batch_tokens,
            max_requests_per_batch=plan.max_requests_per_batch,
            scheduler_type=self.config.scheduler_type,
            safety_margin=self.config.resolved_safety_margin,
            max_model_len=self.max_model_len,
            speculative=self.speculative_config,
            max_scored_tokens=scored_rows(plan.max_requests_per_batch),
            draft_share=0.0 if self._draft_model is None else draft_share(self._draft_model, self.model),
            long_rope_from=spec.long_rope_from,
            long_rope_recomputes=spec.long_rope_recomputes,
        )

    def _bind(self, loop: asyncio.AbstractEventLoop, state: _State, session: Coroutine[Any, Any, None]) -> None:
        """Run ``session`` (the session's task) on ``loop``, which the manager now belongs to."""
        if loop is not self._loop:  # (the same loop when requests were queued before the start)
            self._router.results_changed = asyncio.Event()  # (one per event loop)
        self._loop = loop
        self._state = state
        self._sessions += 1
        self._task = loop.create_task(session, name="aiocb-step-loop")

    async def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """Stop accepting requests, then finish every queued and running one (transformers'
        arguments, in its order).

        With ``hard_stop=True`` they end at once instead: their awaiters and streams get
        :class:`~aiocb.RequestAbortedError`. If ``timeout`` seconds pass before a graceful
        stop completes, the remaining requests are aborted the same way (transformers only
        stops waiting then). With ``block=False`` it returns once the stop has begun, which
        goes on on the loop (``destroy`` waits for it). ``keep_for_next_session=True`` makes
        the manager persistent, as ``persistent_manager=True`` would have: the next
        ``aiocb.Manager(model, persistent_manager=True)`` returns it, its cache kept.
        """
        if keep_for_next_session and not self.persistent:
            self._keep_for_next_session()
        if self._state in (_State.CREATED, _State.STOPPED, _State.DESTROYED, _State.DEAD):
            if self._state is _State.CREATED:
                # Stopped as a session is: what was queued ends, new requests are refused.
                logger.warning("Manager.stop(): the manager was never started")
                if self._queued_before_start:
                    self._check_loop()
                    self._drop_queue_before_start("stop() before start()")
                self._state = _State.STOPPED
            return
        self._check_loop()
        if self._state is _State.STARTING:
            # Stop the session once it runs; a start that fails leaves nothing to stop, and
            # the manager stopped (not startable by the requests made after this stop).
            with contextlib.suppress(Exception):
                await self._until_started()
            if self._state not in (_State.RUNNING, _State.STOPPING):
                if self._state in (_State.CREATED, _State.STOPPED):  # (as before the start)
                    self._state = _State.STOPPED
                return
        self._state = _State.STOPPING
        if self._runner is not None:
            self._runner.notify("stop", hard_stop)  # for the other tensor-parallel ranks
        self._admission.fail(ManagerClosedError("the manager is stopping; the request was not queued"))
        steps = self._steps
        assert steps is not None
        try:
            if hard_stop:
                await self._router.abort_all_in_turns("stop(hard_stop=True) aborted the request")
        finally:
            steps.drain()  # (also when this stop is cancelled meanwhile: the abort is complete)
        if block:
            await self._stopped(timeout)
        else:  # (kept: a task nothing refers to may be collected before it ends)
            self._stopping = asyncio.ensure_future(self._stopped(timeout))

    @staticmethod
    def persistent_manager_of(model: PreTrainedModel) -> Manager | None:
        """The persistent manager ``model`` keeps (one a ``persistent_manager=True``
        construction returns), or None."""
        cached = getattr(model, _CACHED_MANAGER_ATTR, None)
        return cached if isinstance(cached, Manager) and cached._state is not _State.DESTROYED else None

    def _keep_for_next_session(self) -> None:
        if tensor_parallel_layout(self.model) is not None and self._runner is not None:
            # (the follower ranks' runners were built to be dropped at the session's end)
            raise InvalidRequestError(
                "keep_for_next_session: a tensor-parallel manager is kept only when built with persistent_manager=True"
            )
        cached = getattr(self.model, _CACHED_MANAGER_ATTR, None)
        if cached is not None and cached is not self:
            raise InvalidRequestError("keep_for_next_session: the model already keeps another persistent manager")
        self.persistent = True
        setattr(self.model, _CACHED_MANAGER_ATTR, self)

    async def _stopped(self, timeout: float | None) -> None:
        """Wait for the step loop to end, aborting what is left after ``timeout`` seconds."""
        assert self._task is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            logger.warning("Manager.stop(): not finished after %s s; aborting what is left", timeout)
            await self._router.abort_all_in_turns(f"stop(timeout={timeout}) aborted the request")
            await asyncio.shield(self._task)

    async def destroy(self) -> None:
        """Stop if running, free the cache and forget the model; idempotent, final.

        When it returns, nothing in the manager refers to the model runner, its KV cache
        or the step loop any more: they are freed by reference counting alone, whether or
        not the manager itself is kept; under tensor parallelism the other ranks have freed
        their shards of the cache too. Outputs not yet read stay readable.
        """
        if self._state is _State.DESTROYED:
            return
        if self.is_running:
            await self.stop()  # (or joins one begun without blocking)
        if self._queued_before_start:
            self._check_loop()
            self._drop_queue_before_start("destroy() before start()")
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.detach()
            if not runner.closes_remotely:
                runner.close()
                runner = None
        self._layout = None
        if self._steps is not None:
            self._final_statistics = self.statistics()
            self._steps.close()
            self._steps = None  # the scheduler, its block pool and prefix maps
            self._router.steps = None
            self._admission.scheduler = None
        self._requests.close()  # (the tokenizer process, if long prompts started one)
        self._task = None
        self._starting = None
        if self._dead_error is not None:
            # The failure's traceback holds the failed step's frames, and through them the
            # runner and the cache, for as long as any awaiter keeps the error; it is also
            # a cycle: error -> traceback -> _run_steps frame -> manager -> error.
            _release_tracebacks(self._dead_error)
        if getattr(self.model, _CACHED_MANAGER_ATTR, None) is self:
            delattr(self.model, _CACHED_MANAGER_ATTR)
        self._state = _State.DESTROYED
        if runner is not None:
            # A round trip to the other tensor-parallel ranks (up to cpu_group_timeout when
            # one hangs): on a worker thread, once this manager is destroyed (nothing can
            # start it meanwhile); it ends even if this call is cancelled.
            # (handed over in a box the worker empties: the pool's work item would hold a
            # bound method, and the runner with its cache, until the thread moved on)
            box = [runner]
            del runner
            await asyncio.shield(asyncio.to_thread(_close_runner_in, box))

    async def __aenter__(self) -> Manager:
        if self._state is _State.STOPPING:  # (a stop under way, as a cancelled entry's: it ends first)
            await self.stop()
        # (a session another block began, a nested one's or another task's, or start()'s)
        joined = self.is_running
        if joined:
            self._check_loop()
        else:
            self.start()
        try:
            await self.wait_started()
        except BaseException:
            # No __aexit__ follows: a session this entry began and that still starts (the
            # wait was cancelled, by a timeout say) must end, or it would run on with nobody
            # to stop it. The stop begins now; its end waits for the runner's build (a
            # worker thread's, which nothing interrupts), and the destroy after it goes on
            # in a task of its own. (A start that failed left nothing to end.)
            if not joined and self.is_running:
                await self.stop(block=False, hard_stop=True)
                if not self.persistent:
                    self._leaving = asyncio.ensure_future(self._destroy_once_stopped())
            raise
        self._blocks += 1
        return self

    async def _destroy_once_stopped(self) -> None:
        await self.stop()  # (joins the stop under way)
        if self._state is _State.STOPPED:  # (not started again meanwhile)
            await self.destroy()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        self._blocks -= 1
        if self._blocks:
            return  # (a block nested in another, or another task's: the last one out stops it)
        # Leaving because of an error or a cancellation: nobody will read the rest.
        try:
            await self.stop(hard_stop=exc_type is not None)
        except BaseException:
            # (cancelled again while it stopped, as an anyio cancel scope does: the destroy
            # goes on in a task of its own once the stop under way has ended)
            if not self.persistent:
                self._leaving = asyncio.ensure_future(self._destroy_once_stopped())
            raise
        if not self.persistent:
            await self.destroy()

    async def _run_steps(self, steps: StepLoop) -> None:
        try:
            await steps.run()
        except asyncio.CancelledError:
            # The event loop is closing under us (asyncio.run() returned, say).
            self._router.abort_all("the event loop running the manager shut down")
            self._end_session()
            raise
        except GeneratorExit:  # (the coroutine closed with its loop: nothing of the model's)
            raise
        except BaseException as exc:  # (a BaseException of the model's too: pytest.fail in a hook, say)
            self._die(exc)
            if isinstance(exc, _INTERRUPTS):
                raise
        else:
            self._end_session()

    def _drop_queue_before_start(self, cause: str) -> None:
        """Abort the requests queued before a first start that will not come (for ``cause``),
        and those waiting for room in the queue; the queue is made anew for the next."""
        if self._queued_before_start:
            self._drop_queue(cause)

    def _drop_queue(self, cause: str) -> None:
        """Abort what waits in the queue of a session whose steps never ran (for ``cause``),
        and what waits for room in it; the queue is made anew for the next."""
        assert self._steps is not None
        self._stop_deadline_timers()
        self._admission.fail(ManagerClosedError(f"{cause}: the request was not queued"))
        self._router.abort_all(f"{cause} aborted the request")
        self._steps.close()
        self._steps = None
        self._router.steps = None
        self._admission.scheduler = None
        self._loop = None
        self._router.results_changed.set()  # (a get_result() waiting finds nothing will come)

    def _end_session(self) -> None:
        if self._steps is not None:
            # The session's step loop is kept for statistics() only: drop its references
            # to the runner and to this manager (its callback), a cycle otherwise.
            self._steps.close()
        if self._runner is not None:
            self._end_runner_session(self._runner)
        self._state = _State.STOPPED
        self._loop = None
        self._router.results_changed.set()

    def _end_runner_session(self, runner: ModelRunner) -> None:
        """Detach ``runner``; a persistent manager keeps it (and its cache) for its next
        session, another frees it (start() plans and builds a new one)."""
        runner.detach()
        self._runner = runner if self.persistent else None
        if self._runner is None:
            self._layout = None

    def _die(self, exc: BaseException) -> None:
        logger.error("aiocb step loop failed; every pending request fails", exc_info=exc)
        self._dead_error = EngineDeadError(f"the step loop failed: {exc!r}", exc)
        self._state = _State.DEAD
        self._router.fail_all(self._dead_error, exc)
        self._admission.fail(self._dead_error)
        if self._steps is not None:
            self._steps.close()
        if self._runner is not None:
            self._runner.detach()

    def _dead(self) -> EngineDeadError:
        assert self._dead_error is not None
        return EngineDeadError(str(self._dead_error), self._dead_error.cause)

    # ------------------------------------------------------------------ requests

    async def add_request(
        self,
        input_ids: Prompt,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        *,
        sampling_params: SamplingParams | None = None,
        wait: bool = True,
        **params: Any,
    ) -> str:
        """Queue one request and return its id, waiting while the admission queue is full.

        ``input_ids`` are token ids, or with a tokenizer a text or chat messages. The
        request's controls are ``sampling_params`` (:class:`~aiocb.SamplingParams`) and
        any of its fields given as keyword arguments, which take precedence. With
        ``streaming=True`` partial outputs also reach :meth:`get_result` and iteration.
        With ``wait=False`` a full queue raises :class:`~aiocb.WouldBlock` at once, as
        :meth:`add_request_nowait` does, while a long prompt is still tokenized off the
        loop and a request's ``n`` samples made a slice of the loop at a time.
        """
        self._check_loop()  # (before the turnstile, whose waiters the manager's loop releases)
        start = self._start_now()
        await self._turnstile.enter()
        request = await self._prepared(input_ids, request_id, max_new_tokens, sampling_params, params, start)
        if wait:
            await self._wait_for_room(request, start)
        elif not self._has_room(request, start):
            raise WouldBlock(_QUEUE_FULL)
        return self._submit(request, streaming=streaming, consumer=Consumer.RESULTS)

    def add_request_nowait(
        self,
        input_ids: Prompt,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        *,
        sampling_params: SamplingParams | None = None,
        **params: Any,
    ) -> str:
        """Like :meth:`add_request`, but raise :class:`~aiocb.WouldBlock` instead of waiting.

        Everything is done right here, on the event loop's thread: a text prompt tokenized,
        and controls that list many token ids (a ``logit_bias``, ``allowed_token_ids`` or
        ``bad_words_ids`` over much of the vocabulary: some 0.4 µs an id), which
        :meth:`add_request` checks on a worker thread.
        """
        prompt = self._requests.encode_now(input_ids)
        request = self._new_request(prompt, request_id, max_new_tokens, sampling_params, params)
        if not self._admission.has_room(request):
            raise WouldBlock(_QUEUE_FULL)
        return self._submit(request, streaming=streaming, consumer=Consumer.RESULTS)

    async def add_requests(
        self,
        inputs: Sequence[Prompt],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        *,
        sampling_params: SamplingParams | None = None,
        **params: Any,
    ) -> list[str]:
        """Queue many requests; returns their ids in input order.

        With block sharing on, they are submitted sorted by prompt so that prompts with a
        common prefix are neighbours in the queue.
        """
        requests = await self._add_many(
            inputs, max_new_tokens, sampling_params, params, streaming=streaming, consumer=Consumer.RESULTS
        )
        return [r.request_id for r in requests]

    def cancel_request(self, request_id: str) -> bool:
        """End a queued or running request now, with its other samples (``n``; a sample's
        own id, ``<id>__child#<i>``, ends that sample alone); its blocks are free when this
        returns (or, if the step being planned holds them, once its copy for the device is
        complete). Past its first 64 samples the others end a slice of the loop at a time,
        in the loop turns that follow (each takes some 10 µs).

        Returns whether a live request was cancelled (unknown or finished ids are ignored).
        """
        self._check_loop()
        return self._steps is not None and self._router.cancel_with_samples(request_id)

    @overload
    async def generate(
        self,
        input_ids: Prompt,
        max_new_tokens: int | None = None,
        *,
        request_id: str | None = None,
        sampling_params: SamplingParams | None = None,
        n: Literal[1],
        **params: Any,
    ) -> GenerationOutput: ...

    @overload
    async def generate(
        self,
        input_ids: Prompt,
        max_new_tokens: int | None = None,
        *,
        request_id: str | None = None,
        sampling_params: None = None,
        n: None = None,
        **params: Any,
    ) -> GenerationOutput: ...

    @overload
    async def generate(
        self,
        input_ids: Prompt,
        max_new_tokens: int | None = None,
        *,
        request_id: str | None = None,
        sampling_params: SamplingParams | None = None,
        n: int,
        **params: Any,
    ) -> list[GenerationOutput]: ...

    @overload
    async def generate(
        self,
        input_ids: Prompt,
        max_new_tokens: int | None = None,
        *,
        request_id: str | None = None,
        sampling_params: SamplingParams,
        n: None = None,
        **params: Any,
    ) -> GenerationOutput | list[GenerationOutput]: ...

    async def generate(
        self,
        input_ids: Prompt,
        max_new_tokens: int | None = None,
        *,
        request_id: str | None = None,
        sampling_params: SamplingParams | None = None,
        n: int | None = None,
        **params: Any,
    ) -> GenerationOutput | list[GenerationOutput]:
        """Run one request to its end and return its final :class:`~aiocb.GenerationOutput`;
        with ``n`` > 1, the list of the ``n`` samples' outputs (the request's, then its
        children's), whose prompt is computed once. ``n`` is this call's, else
        ``sampling_params``'s, else the manager's GenerationConfig's ``num_return_sequences``:
        a manager whose config sets that above 1 returns lists where the types, which see
        only this call's arguments, say one output.

        Cancelling the awaiting task cancels the request.
        """
        self._check_loop()  # (before the turnstile, whose waiters the manager's loop releases)
        start = self._start_now()
        await self._turnstile.enter()
        if n is not None:
            params["n"] = n
        request = await self._prepared(input_ids, request_id, max_new_tokens, sampling_params, params, start)
        await self._wait_for_room(request, start)
        handles = self._submit_group(request, streaming=False, consumer=Consumer.AWAITER)
        if not request.children:
            return await self._router.final(handles[0])
        try:
            return [await self._router.final(handle) for handle in handles]
        except BaseException:
            await each_in_turns(handles, self._router.cancel_own)  # (n = 4,096: 16 ms in one pass)
            raise

    async def generate_batch(
        self,
        inputs: Sequence[Prompt],
        max_new_tokens: int | None = None,
        *,
        progress: bool = False,
        sampling_params: SamplingParams | None = None,
        **params: Any,
    ) -> dict[str, GenerationOutput]:
        """Run many requests to their end; returns ``{request_id: output}`` in input order.

        With ``n`` > 1, each request's children (``<id>__child#<i>``) come before it, as in
        transformers."""
        check_prompt_list(inputs)
        bar = _progress_bar(len(inputs)) if progress else None
        requests = await self._add_many(
            inputs,
            max_new_tokens,
            sampling_params,
            params,
            streaming=False,
            consumer=Consumer.AWAITER,
            on_finish=bar.update if bar is not None else None,
        )
        order = [r for parent in requests for r in (*parent.children, parent)]
        handles: list[RequestHandle | None] = []
        try:
            turn = LoopTurn()  # (20,000 lookups held the loop some 10 ms)
            for request in order:
                handles.append(self._router.get(request.request_id))
                await turn.give()
            if bar is not None and bar.total != len(order):
                bar.total = len(order)  # (every sample of every prompt)
                bar.refresh()
            outputs = await self._collect(order, handles)
        except BaseException:
            # (looked up again: the lookups may not have been made yet)
            await each_in_turns(order, self._cancel_own_request)
            raise
        finally:
            if bar is not None:
                bar.close()
        # The finished requests are let go of a slice of the loop at a time (20,000 of them
        # freed as this returned held it some 20 ms): held by ``order`` alone from here.
        requests.clear()
        handles.clear()
        await release(order)
        return outputs

    def stream(self, request_id: str) -> RequestStream:
        """Iterate the outputs of one request: each new output carries every token so far,
        the last one is final (``status`` ``FINISHED``, or ``CANCELLED`` / ``FAILED``).

        Closing the stream (``aclose()``, or leaving ``async with manager.stream(...)``) or
        cancelling the task iterating it cancels the request; breaking out of the loop does
        too once nothing refers to the stream any more (it is cancelled when collected).
        """
        self._check_loop()
        handle = self._router.claim_for_stream(request_id)
        return RequestStream(self._router, handle, self._loop or asyncio.get_running_loop())

    async def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output from the shared results, or the next one of ``request_id``.

        Returns None when ``timeout`` passes first, or (without a request id) when the
        manager is not running and no result is left. Raises ``InvalidRequestError`` when
        no live request has the id, or when another caller waiting on the same request
        took its final output.
        """
        self._check_loop()
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout)
        ):
            raise InvalidRequestError(f"timeout must be a number of seconds or None, got {timeout!r}", param="timeout")
        try:
            async with asyncio.timeout(timeout):
                if request_id is None:
                    return await self._router.next_shared(self._results_may_come)
                return await self._router.next_of(request_id)
        except TimeoutError:
            return None

    def __aiter__(self) -> AsyncIterator[GenerationOutput]:
        return self._iterate_results()

    async def _iterate_results(self) -> AsyncIterator[GenerationOutput]:
        while (output := await self.get_result()) is not None:
            yield output

    def statistics(self) -> ManagerStatistics:
        """A snapshot of queue lengths, cache use and counters."""
        steps = self._steps
        if steps is None and self._final_statistics is not None:
            return self._final_statistics
        if steps is None:
            return ManagerStatistics(self.is_running, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0)
        scheduler = steps.scheduler
        kv = scheduler.kv_cache
        stats = scheduler.stats
        return ManagerStatistics(
            is_running=self.is_running,
            running_requests=len(scheduler.running),
            waiting_requests=len(scheduler.waiting) + scheduler.num_held_children,
            free_blocks=kv.num_free_blocks,
            total_blocks=kv.num_total_blocks,
            cache_usage=1.0 - kv.free_fraction,  # (the tightest group's: a hybrid model's full layers')
            steps=stats.num_steps,
            tokens_computed=stats.num_computed_tokens,
            tokens_generated=stats.num_generated_tokens,
            preemptions=stats.num_preemptions,
            recomputed_tokens=stats.num_recomputed_tokens,
            prefix_hit_tokens=kv.num_prefix_hit_tokens,
            offloaded_blocks=kv.num_offloaded_blocks,
            restored_blocks=kv.num_restored_blocks,
            draft_tokens=stats.num_draft_tokens,
            accepted_draft_tokens=stats.num_accepted_tokens,
            capacity_tokens=kv.capacity_tokens,
        )

    # ------------------------------------------------------------------ internals

    def _check_loop(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise WrongEventLoopError(
                "a manager is used from its event loop's thread, in async code; from another "
                "thread, use asyncio.run_coroutine_threadsafe() or loop.call_soon_threadsafe()"
            ) from None
        self._forget_a_closed_loop()
        if self._loop is not None and loop is not self._loop:
            raise self._wrong_loop()

    def _forget_a_closed_loop(self) -> None:
        """A session whose event loop was closed without stopping it (``loop.close()`` after
        ``run_until_complete``, no task cancelled) can never resume: end it as
        ``asyncio.run()``'s cancellation would, so that the manager starts anew elsewhere."""
        if self._loop is None or not self._loop.is_closed():
            return
        # Whoever waited there can never be woken (a wake-up scheduled on the closed loop
        # raises): the shared results' event, the room in the queue and the turnstile's
        # places are made anew for the next loop.
        self._router.results_changed = asyncio.Event()
        self._admission.forget()
        self._turnstile = Turnstile()
        self._blocks = 0  # (that loop's blocks never leave)
        if self._state is _State.CREATED:
            logger.warning("the event loop requests were queued on was closed before the manager started")
            self._drop_queue_before_start("the event loop it was queued on closed before the start")
        elif self._state in (_State.STARTING, _State.RUNNING, _State.STOPPING):
            logger.warning("the event loop this manager ran on was closed without stopping it; its session ends")
            self._router.abort_all("the event loop running the manager was closed")
            self._starting = None  # (a start of that loop's, which will never end)
            if self._pending_build is not None:  # (a runner built for that session: never collected)
                self._pending_build.abandon()
                self._abandoned_build, self._pending_build = self._pending_build, None
            self._end_session()
        elif self._state is _State.DEAD:
            self._loop = None  # (nothing runs there: from any loop, callers hear of the failure)

    def _wrong_loop(self) -> WrongEventLoopError:
        return WrongEventLoopError(
            "this manager runs on another event loop than the caller's; use it from the loop "
            "it was started on, or stop() it there before using it from a new loop"
        )

    def _check_accepting(self) -> None:
        """Raise unless requests may be made now; before the first start (on one process)
        they may, and the queue they wait in is made (see :meth:`start`)."""
        if self._state is _State.RUNNING:
            return
        if self._state is _State.DEAD:
            raise self._dead()
        if self._state is _State.CREATED and driver_layout(self.model, self._draft_model) is None:
            if self._steps is None:  # (made once; bound to the loop when a request joins it)
                self._make_steps()
            return
        message = {
            _State.CREATED: "the manager is not started: under tensor parallelism requests are made after "
            "start() (await manager.wait_started()), or in `async with`",
            _State.STARTING: "the manager is still starting (it reaches the other tensor-parallel ranks): "
            "await manager.wait_started() before add_request_nowait()",
            _State.STOPPING: "the manager is stopping and accepts no new requests",
            _State.STOPPED: "the manager is stopped and accepts no new requests; call start() again",
            _State.DESTROYED: "the manager was destroyed",
        }[self._state]
        if self._refusals_logged is not self._state:  # (a stop with 1,000 callers under way: one line)
            self._refusals_logged = self._state
            logger.warning("request refused: %s (others refused so are not logged)", message)
        raise ManagerClosedError(message)

    def _results_may_come(self) -> bool:
        """Whether the shared results can still grow (raises if the engine died)."""
        if self._state is _State.DEAD:
            raise self._dead()
        return self.is_running or self._queued_before_start

    async def _prepared(
        self,
        input_ids: Prompt,
        request_id: str | None,
        max_new_tokens: int | None,
        sampling_params: SamplingParams | None,
        params: dict[str, Any],
        start: _Began,
    ) -> Request:
        """A request built from a prompt, with its tokenizing and its constraint's
        compiling done off the loop where they are long (for the session whose ``start``
        was under way when its caller began, if one was: see :meth:`_check_start`)."""
        await self._until_started()
        self._check_accepting()  # (before the first start: the runner whose vocabulary constraints use)
        structured = asks_for_structure(sampling_params, params)
        keep = None
        if structured or is_large(input_ids) or is_long_id_prompt(input_ids):
            # Merged once, here (what follows takes it as it is), on a worker thread where
            # its check is long: a constraint written as JSON (a structural tag of 256 tools'
            # schemas took 3.5 ms, and was written twice), large controls.
            merge = self._requests.merged
            if has_large_controls(sampling_params, params) or _long_structure(params):
                requested = await asyncio.to_thread(pausing_call, merge, sampling_params, max_new_tokens, params)
            else:
                requested = merge(sampling_params, max_new_tokens, params)
            sampling_params, max_new_tokens, params = requested, None, {}
            keep = requested.truncate_prompt_tokens
        ids = await self._requests.encode(
            input_ids, keep=keep, limit=self.max_model_len, vocab_size=self._model_spec.vocab_size
        )
        if structured:
            assert sampling_params is not None
            await self._precompile(sampling_params)
        await self._requests.tokenize_bad_words(sampling_params, params)
        stops = await self._requests.prepare_stops(sampling_params, params)
        checked = None
        if has_large_controls(sampling_params, params):
            checked = await self._checked_off_the_loop(ids, max_new_tokens, sampling_params, params)
        self._check_start(start)
        request, samples = self._build(ids, request_id, max_new_tokens, sampling_params, params, checked)
        del stops  # (held until the request's text tracker holds it)
        await _indexed(request)
        turn = LoopTurn()  # (n = 1,024 samples take about 6 ms)
        for sample in samples:
            if not request.children:
                request.children = []
            request.children.append(sample)
            await turn.give()
        return request

    async def _precompile(self, requested: SamplingParams) -> None:
        """Compile a request's output constraint off the loop (when it has one)."""
        if requested.structure() is not None:
            await self._requests.precompile(requested, self._model_spec.vocab_size)

    async def precompile(self, sampling_params: SamplingParams | None = None, **params: Any) -> None:
        """Compile the output constraint these parameters carry (``json_schema``, ``regex``,
        ``choice``, ``grammar`` or ``structural_tag``) on a worker thread and cache it, so that a request added
        with them later, by :meth:`add_request_nowait` too, does not compile it on the loop.
        Raises :class:`~aiocb.InvalidRequestError` when it does not compile."""
        self._check_loop()
        await self._until_started()
        self._check_accepting()
        await self._precompile(self._requests.merged(sampling_params, None, params))

    def _new_request(
        self,
        input_ids: Any,
        request_id: str | None,
        max_new_tokens: int | None,
        sampling_params: SamplingParams | None,
        params: dict[str, Any],
        checked: CheckedRequest | None = None,
    ) -> Request:
        request, samples = self._build(input_ids, request_id, max_new_tokens, sampling_params, params, checked)
        children = list(samples)
        if children:
            request.children = children
        return request

    @property
    def _model_spec(self) -> ModelSpec:
        """The model's layout, once requests are accepted: the runner's, or on one process
        the plan's while the runner is built."""
        if self._runner is not None:
            return self._runner.spec
        assert self._layout is not None
        return self._layout[0]

    def _build(
        self,
        input_ids: Any,
        request_id: str | None,
        max_new_tokens: int | None,
        sampling_params: SamplingParams | None,
        params: dict[str, Any],
        checked: CheckedRequest | None = None,
    ) -> tuple[Request, Iterator[Request]]:
        """A request checked against what it must fit (on the manager's loop, while it
        accepts requests; ``checked``: already, on a worker thread, unless the limits have
        changed since), and the maker of its other samples."""
        self._check_loop()
        self._check_accepting()
        limits = self._limits()
        if checked is None or checked.limits != limits:
            checked = self._requests.check(input_ids, max_new_tokens, sampling_params, params, limits)
        return self._requests.build(checked, request_id, in_use=self._router)

    async def _checked_off_the_loop(
        self, ids: Any, max_new_tokens: int | None, sampling_params: SamplingParams | None, params: dict[str, Any]
    ) -> CheckedRequest:
        """A request with large controls (:func:`~aiocb.engine.requests.has_large_controls`)
        checked on a worker thread, a slice at a time with pauses for the loop."""
        self._check_accepting()  # (the awaits before may have seen the manager stop)
        limits = self._limits()
        check = self._requests.check
        return await asyncio.to_thread(pausing_call, check, ids, max_new_tokens, sampling_params, params, limits, True)

    def _limits(self) -> RequestLimits:
        """What a request must fit: the model's vocabulary and context, the whole cache."""
        assert self._steps is not None
        spec = self._model_spec
        capacity = self._steps.scheduler.kv_cache.capacity_tokens
        return RequestLimits(spec.vocab_size, self.max_model_len, capacity)

    async def _add_many(
        self,
        inputs: Sequence[Prompt],
        max_new_tokens: int | None,
        sampling_params: SamplingParams | None,
        params: dict[str, Any],
        *,
        streaming: bool,
        consumer: Consumer,
        on_finish: Callable[[], object] | None = None,
    ) -> list[Request]:
        self._check_loop()
        check_prompt_list(inputs)
        start = self._start_now()
        await self._until_started()
        self._check_accepting()
        requests: list[Request] = []
        # The same parameters for every prompt: merged once, not once per request.
        large = has_large_controls(sampling_params, params)
        if large:
            merge = self._requests.merged
            sampling_params = await asyncio.to_thread(pausing_call, merge, sampling_params, max_new_tokens, params)
        else:
            sampling_params = self._requests.merged(sampling_params, max_new_tokens, params)
        await self._precompile(sampling_params)
        await self._requests.tokenize_bad_words(sampling_params, {})
        stops = await self._requests.prepare_stops(sampling_params, {})  # (held while the requests are made)
        turn = LoopTurn()  # (a long list must not hold the loop in one go)
        self._check_accepting()  # (stopped while they were prepared: the session's layout is gone)
        keep, limit = sampling_params.truncate_prompt_tokens, self.max_model_len
        for index, prompt in enumerate(inputs):
            await turn.give()
            self._check_accepting()
            try:
                ids = await self._requests.encode(
                    prompt, keep=keep, limit=limit, vocab_size=self._model_spec.vocab_size
                )
                checked = await self._checked_off_the_loop(ids, None, sampling_params, {}) if large else None
                self._check_start(start)
                requests.append(self._new_request(ids, None, None, sampling_params, {}, checked))
            except InvalidRequestError as exc:  # (which of thousands of prompts it was)
                raise type(exc)(f"inputs[{index}]: {exc}", param=exc.param) from None
        del stops  # (the requests' text trackers hold it now)
        for request in requests:  # (they share one index, as a rule: it is built once)
            await _indexed(request)
            await turn.give()
        order = list(range(len(requests)))
        if self.config.allow_block_sharing:  # (prompts that share a prefix queued together)
            keys: list[bytes] = []
            for request in requests:
                keys.append(_prefix_key(request.prompt_ids))
                await turn.give()
            order = await sorted_in_turns(order, keys.__getitem__, turn)
            del keys
        submitted: list[RequestHandle] = []
        try:
            for i in order:
                await turn.give()
                await self._wait_for_room(requests[i], start)
                submitted += self._submit_group(
                    requests[i], streaming=streaming, consumer=consumer, on_finish=on_finish
                )
        except BaseException:
            await each_in_turns(submitted, self._router.cancel_own)
            raise
        return requests

    def _cancel_own_request(self, request: Request) -> None:
        """Cancel ``request`` while its id is still its own (a caller cleaning up)."""
        if (handle := self._router.get(request.request_id)) is not None and handle.request is request:
            self._router.cancel_own(handle)

    async def _collect(self, order: list[Request], handles: list[RequestHandle | None]) -> dict[str, GenerationOutput]:
        """The final outputs of ``order``'s requests (those with a handle), in order. Many
        requests end in the same step: their outputs are made a slice at a time, since a
        thousand of them at once hold the loop for milliseconds."""
        outputs: dict[str, GenerationOutput] = {}
        turn = LoopTurn()
        for request, handle in zip(order, handles, strict=True):
            if handle:
                outputs[request.request_id] = await self._router.final(handle)
                await turn.give()
        return outputs

    async def _wait_for_room(self, request: Request, start: _Began) -> None:
        """Wait for room in the queue; refused first when the manager stopped (or was
        destroyed, or its start failed) while the request was made, since making it awaits."""
        self._check_start(start)
        self._check_accepting()
        await self._admission.wait_for_room(request)

    def _has_room(self, request: Request, start: _Began) -> bool:
        self._check_start(start)
        self._check_accepting()
        return self._admission.has_room(request)

    def _start_now(self) -> _Began:
        """When a request's caller begins: how many sessions had begun, and whether one runs
        (see :meth:`_check_start`)."""
        return self._sessions, self.is_running

    def _check_start(self, began: _Began) -> None:
        """Refuse a request whose caller began while a start was under way, or before a
        start that came since, once the manager is back as before its first start because
        that start failed: the requests queued for it were aborted, and this one, made
        meanwhile, must not wait in the queue of a start that may never come. (Where a
        later start runs, the request joins its session.)"""
        sessions, running = began
        failure = self._start_failure
        if self._state is _State.CREATED and (running or sessions != self._sessions) and failure is not None:
            raise ManagerClosedError(f"the manager's start failed ({failure!r}): the request was not queued")

    def _submit(self, request: Request, *, streaming: bool, consumer: Consumer) -> str:
        self._submit_group(request, streaming=streaming, consumer=consumer)
        return request.request_id

    def _queue_on_this_loop(self, request: Request) -> None:
        """Before the steps run (before the first start, or while the runner is built): a
        request with a timeout ends at its deadline even if they have not begun by then;
        before the first start the queue belongs to the running loop from the first request
        it takes (the start must come on that loop)."""
        loop = asyncio.get_running_loop()
        if self._state is _State.CREATED and not self._queued_before_start:
            logger.info("the manager is not started: requests wait in its queue until start()")
            self._loop = loop
            self._router.results_changed = asyncio.Event()
        if request.deadline is not None:
            delay = max(0.0, request.deadline - time.perf_counter())
            self._deadline_timers.append(loop.call_later(delay, self._expire_before_start))

    def _submit_group(
        self,
        request: Request,
        *,
        streaming: bool,
        consumer: Consumer,
        on_finish: Callable[[], object] | None = None,
    ) -> list[RequestHandle]:
        """Queue a request and its samples; their handles, the request's first."""
        try:
            self._check_accepting()
            group = [request, *request.children]
            handles = self._router.register(group, streaming=streaming, consumer=consumer, on_finish=on_finish)
        except BaseException:
            # (the room it was given goes to the next caller waiting: an idle engine has
            # no step that would hand it on)
            self._admission.release()
            raise
        assert self._steps is not None
        if self._steps.runner is None:
            self._queue_on_this_loop(request)
        if request.deadline is not None and request.deadline <= time.perf_counter():
            # They spent their whole timeout waiting for room in the queue.
            for handle in handles:
                self._router.end(handle, FinishReason.TIMEOUT, status=RequestStatus.FINISHED)
        else:
            self._steps.add(request, request.children)
        return handles


class _Build:
    """A runner built and attached on a worker thread for a session that may end before
    it is collected (its event loop closed): such a runner is detached, not left attached
    to the model, and a build for a later session waits for it (``after``) rather than
    attach the model at the same time."""

    def __init__(self, after: _Build | None = None) -> None:
        self._lock = threading.Lock()
        self._abandoned = False
        self._runner: ModelRunner | None = None
        self._after = after
        self._done = threading.Event()

    def run(self, attached: Callable[[ModelRunner | None], ModelRunner], runner: ModelRunner | None) -> ModelRunner:
        """``attached(runner)``, on the worker thread."""
        try:
            if self._after is not None:
                self._after._done.wait()
                self._after = None
            made = attached(runner)
            with self._lock:
                if self._abandoned:
                    made.detach()
                else:
                    self._runner = made
            return made
        finally:
            self._done.set()

    def abandon(self) -> None:
        """Nobody will collect the runner: detach it, now or once it is attached."""
        with self._lock:
            self._abandoned = True
            if self._runner is not None:
                self._runner.detach()
                self._runner = None


#: sequence biases and bad words a request may have indexed on the loop, in the step that
#: admits it (some 30 µs; a step admits up to 32 requests a turn)
_LARGE_SEQUENCE_INDEX = 32


#: the characters of an output constraint given as text that a request's check reads on
#: the loop (parsed and written as JSON: some 10 µs a kilobyte)
_SHORT_STRUCTURE = 4096


def _long_structure(params: dict[str, Any]) -> bool:
    """Whether keyword fields give an output constraint whose check may be long: any but a
    short text (a dict is written as JSON, a pydantic class asked for its schema, a
    ``choice``'s texts checked one by one)."""
    for name in STRUCTURE_FIELDS:
        value = params.get(name)
        if value is not None and not (isinstance(value, str) and len(value) <= _SHORT_STRUCTURE):
            return True
    return False


async def _indexed(request: Request) -> None:
    """Index ``request``'s sequence biases and bad words on a worker thread where they are
    more than :data:`_LARGE_SEQUENCE_INDEX` (about 1 ms a thousand) and not indexed yet."""
    index = request.params.sequence_index
    if index is not None and not index.built and len(index) > _LARGE_SEQUENCE_INDEX:
        await asyncio.to_thread(index.build, yield_gil)


#: when a request's caller began: sessions begun by then, and whether one ran
_Began = tuple[int, bool]

#: what WouldBlock says
_QUEUE_FULL = "the admission queue is full (max_queue_size / max_queued_tokens)"

_model_frozen = False


def _freeze_the_first_managers_model() -> None:
    """Freeze what came after this module's import (the model, its modeling code, a
    tokenizer), once per process, as the first manager is being created: the model is an
    argument, so it is alive, while the manager, its runner and its KV cache are not yet.

    The libraries were frozen when this module was imported (below), usually before any
    event loop runs; what is left for this collection is the model and what loading it
    imported: a few milliseconds on the loop where the whole set took 150 ms. Not later
    managers: a frozen object is never collected as part of a cycle, so freezing a
    manager would pin its step loop, runner and cache for the life of the process."""
    global _model_frozen
    if not _model_frozen:
        _model_frozen = True
        freeze_alive_objects()


def _close_runner_in(box: list[ModelRunner]) -> None:
    """Close the runner ``box`` holds, leaving no reference to it behind (see :meth:`Manager.destroy`)."""
    box.pop().close()


def _release_tracebacks(error: BaseException) -> None:
    """Detach the tracebacks of ``error`` and of its causes and contexts, keeping them as text.

    A traceback holds the frames of the failed step (the step loop, the runner, the
    batch's tensors, and through the closures of the frames' functions, the attention
    metadata and with it the KV cache) for as long as anyone holds the error. Each one
    becomes a note on its exception, so that printing the error still shows where it was
    raised, and its frames' locals are cleared for whoever holds the traceback itself (a
    logging record, say).
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        pending += [exc.__cause__, exc.__context__]
        tb = exc.__traceback__
        if tb is None:
            continue
        frames = "".join(traceback.format_tb(tb))
        exc.add_note(f"Traceback (frames released when the manager was destroyed):\n{frames.rstrip()}")
        traceback.clear_frames(tb)
        exc.__traceback__ = None


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="aiocb", unit="req")


# Torch and transformers are imported by now: their objects go out of the collector's view
# here, at import (at the top of a program, before its event loop runs, as the README asks), so that
# the first manager's own freeze, which may come on a running loop, has only the model
# and what came after it to collect.
freeze_alive_objects()
