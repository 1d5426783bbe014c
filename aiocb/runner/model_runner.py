"""Runs steps of a transformers model over the paged cache (torch only, no asyncio).

A step is *launched* (inputs copied, forward pass and sampling enqueued on the device,
results copied back without blocking) and later *collected* (wait for the copy, turn
tensors into lists). Between the two, the next step may be launched: its decode inputs
are read on the device from this step's sampled tokens (async batching).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from aiocb.collector import freeze_alive_objects
from aiocb.config import DEFAULT_MAX_BLOCKS_PER_REQUEST, ContinuousBatchingConfig
from aiocb.core.scheduler import PromptTops, StepResult
from aiocb.errors import InvalidConfigError
from aiocb.runner import attention, native
from aiocb.runner.backends import Backend, select_backends
from aiocb.runner.compile import compile_configs, compiled
from aiocb.runner.cuda_graphs import DecodeGraphs, query_widths
from aiocb.runner.draft import Drafter, draft_spec, refuse_other_kernels
from aiocb.runner.input_batch import InputBatch
from aiocb.runner.inputs import HostToDevice, StepInputs, prepare_inputs
from aiocb.runner.memory import CachePlan, plan_cache
from aiocb.runner.model_spec import ModelSpec, model_spec
from aiocb.runner.paged_cache import PagedKVCache
from aiocb.runner.sampler import compile_draw, sample, score
from aiocb.runner.step_batch import BatchWriter, StepBatch
from aiocb.runner.tp_layout import tensor_parallel_layout
from aiocb.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingStep:
    """A launched step: its results on their way to the host."""

    prompt_counts: list[int]
    event: torch.cuda.Event | None
    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_values: torch.Tensor | None
    prompt_chosen: torch.Tensor | None
    prompt_top_ids: torch.Tensor | None
    prompt_top_values: torch.Tensor | None
    #: the draft model's proposals, row by row (speculative decoding with a draft model)
    proposed: torch.Tensor | None = None
    #: rows whose controls or grammar mask left no token (see ``Sampled.blocked``)
    blocked: torch.Tensor | None = None


def _plan(
    spec: ModelSpec,
    drafted: ModelSpec | None,
    config: ContinuousBatchingConfig,
    num_requests_hint: int | None,
    speculative: SpeculativeConfig | None,
) -> CachePlan:
    # (a draft model's cache mirrors the target's blocks: each block costs both)
    extra = 0 if drafted is None else drafted.bytes_per_block(config.page_size, drafted.num_layers)
    return plan_cache(
        spec, config, num_requests_hint=num_requests_hint, extra_bytes_per_block=extra, speculative=speculative
    )


def runner_plan(
    model: PreTrainedModel,
    config: ContinuousBatchingConfig,
    *,
    num_requests_hint: int | None = None,
    draft_model: PreTrainedModel | None = None,
    speculative: SpeculativeConfig | None = None,
) -> tuple[ModelSpec, CachePlan]:
    """The layout and cache plan of the runner these arguments build (give it the plan),
    found in a fraction of a millisecond where building the runner allocates the cache: the
    manager checks requests against them on the event loop while the runner is built off
    it. Raises what building would for the plan (no cache fits) or the draft model."""
    spec = model_spec(model)
    drafted = None if draft_model is None else draft_spec(draft_model)
    plan = _plan(spec, drafted, config, num_requests_hint, speculative)
    if drafted is not None:
        windows = [window for window, _ in spec.group_layers()]
        if windows[0] is not None:  # (its cache mirrors the blocks of the full-attention layers)
            raise InvalidConfigError(
                "a draft model needs a target with full-attention layers, not sliding-window ones alone; prompt "
                "lookup (method='ngram') takes it"
            )
        backends = select_backends(
            spec.device, config, windows, plan.page_size, dtype=spec.dtype, head_dim=spec.head_dim, sinks=spec.sinks
        )
        refuse_other_kernels(drafted, plan, config, backends)
    return spec, plan


class ModelRunner:
    """Owns the model's paged cache and turns :class:`StepBatch` plans into sampled tokens."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: ContinuousBatchingConfig,
        *,
        num_requests_hint: int | None = None,
        plan: CachePlan | None = None,
        draft_model: PreTrainedModel | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.spec: ModelSpec = model_spec(model)
        drafted = None if draft_model is None else draft_spec(draft_model)
        # Under tensor parallelism every rank gets the plan all ranks agreed on.
        self.plan: CachePlan = plan or _plan(self.spec, drafted, config, num_requests_hint, speculative)
        self.cache = PagedKVCache(self.spec, self.plan)
        self.backends = select_backends(
            self.device,
            config,
            self.cache.group_windows,
            self.plan.page_size,
            dtype=self.spec.dtype,
            head_dim=self.spec.head_dim,
            sinks=self.spec.sinks,
        )
        #: speculative decoding's draft model, run inside each step (None: no draft model)
        self.drafter = None
        if draft_model is not None and drafted is not None:
            self.drafter = Drafter(draft_model, drafted, self.plan, config, self.backends, self.spec.vocab_size)
        self._transfer = HostToDevice(self.device)
        self._new_batch()
        graphed = self._decode_graphs_wanted()
        tensor_parallel = tensor_parallel_layout(model) is not None
        varlen_config, decode_config = compile_configs(config, decode_graphs=graphed, tensor_parallel=tensor_parallel)
        self._varlen_model = compiled(model, varlen_config)
        self._decode_model = compiled(model, decode_config)
        # Steps that verify proposals get graphs of their own on one process (under tensor
        # parallelism the followers capture the decode graphs alone, in step with rank 0).
        wide = None if speculative is None or tensor_parallel else speculative
        #: decode steps' CUDA graphs, and those of steps that verify proposals (None: such
        #: steps run eagerly), captured by :meth:`warm_up`; the draft model has its own
        self.graphs = self._graphs(self._decode_model, self.cache, wide) if graphed else None
        if self.drafter is not None and graphed and wide is not None:
            self.drafter.graphs = self._graphs(self.drafter.model, self.drafter.cache, wide, draft=True)
        #: what a step that verifies proposals costs against a decode step that replays a
        #: graph, measured by :meth:`warm_up` (1.0: no graphs, or not measured yet)
        self.verify_cost = 1.0
        self.async_batching = self._resolve_async_batching()
        self._last_tokens: torch.Tensor | None = None
        #: whether this holds the model's attention (see :func:`attention.install`)
        self._attached = False
        #: whether :meth:`load_kernels` ran (before the first step, on the step thread)
        self._kernels_loaded = False

    @property
    def device(self) -> torch.device:
        """Where the model and its cache live."""
        return self.spec.device

    def bind_thread(self) -> None:
        """Make the model's device the calling thread's current CUDA device (each worker
        thread runs this first): Triton launches its kernels, and CUDA graphs capture, on
        the current device, which is the thread's own and starts as device 0."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def attach(self) -> None:
        """Start a session: route the model's attention through the paged cache (idempotent
        within a session). A persistent manager's runner serves several sessions: each
        starts with an empty persistent batch (the last session's rows never departed from
        it, and a copy cut short by the end of its event loop may be half made)."""
        if not self._attached:
            self._new_batch()
            attention.hold(self.model, self.spec.long_rope_from)
            self._attached = True
        if self.drafter is not None:
            self.drafter.attach()

    def _new_batch(self) -> None:
        groups = range(len(self.cache.group_windows))
        #: the event loop's side of the persistent batch (it copies plans out) ...
        self.writer = BatchWriter(len(groups), self.spec.vocab_size, self.spec.long_rope_from)
        #: ... and the worker's (every slot's tables and sampling parameters)
        self.input_batch = InputBatch([self.cache.null_block(g) for g in groups])

    def detach(self) -> None:
        """Give the model back its original attention implementation (idempotent)."""
        if self._attached:
            attention.let_go(self.model, self.spec.long_rope_from)
            self._attached = False
        if self.drafter is not None:
            self.drafter.detach()

    #: whether :meth:`close` waits for other processes (tensor parallelism): the manager
    #: then calls it on a worker thread, off the event loop
    closes_remotely: ClassVar[bool] = False

    def close(self) -> None:
        """Free what outlives the last session, when the manager is destroyed: nothing
        here (the cache goes with the runner); the other ranks' caches under tensor
        parallelism."""

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Work done once before the first step, on the step thread (off the event loop):
        capturing every decode CUDA graph, so that no capture lands in a served or timed
        step (``graphs.capture_seconds`` says how long it took), and compiling the GPU
        sampler's kernels, so that no sampled step waits for the compiler. Idempotent."""
        self.load_kernels()
        if self.graphs is not None:
            captures = self.graphs.captures
            graphs = self._capture_graphs()
            if graphs is not None:
                if graphs.captures > captures and self._decode_model is not self.model:
                    _freeze_what_the_compile_made()
                # (the model as steps without a graph run it)
                varlen_model = self._varlen_model
                self.verify_cost = graphs.verify_cost(
                    lambda ids, pos, keep, meta: attention.forward(varlen_model, ids, pos, keep, meta)
                )
                logger.info("a step that verifies proposals costs %.2fx a decode step", self.verify_cost)
        self.compile_sampler()

    def load_kernels(self) -> None:
        """Build (once per machine) or load aiocb's CPU C kernels where a cache group attends
        through them (the ``cpu`` backend), so that the event loop that built the runner never
        waits for a compiler; where they cannot be built, those groups (the draft model's
        too: it shares :attr:`backends`) attend through the ``reference`` backend instead."""
        if Backend.CPU in self.backends and native.library() is None:
            self.backends[:] = [Backend.REFERENCE if b == Backend.CPU else b for b in self.backends]  # (logged)
        self._kernels_loaded = True

    def _capture_graphs(self) -> DecodeGraphs | None:
        """Capture the decode graphs, and those of steps that verify proposals and of the
        draft model; the decode graphs in use after (None: decode steps run eagerly).

        Those of verification and the draft only speed speculation up: if their capture
        fails, such steps and the draft's passes run eagerly (with the error logged) rather
        than not at all. So do decode steps, on the model itself, if theirs fails where the
        graphs were the device's default (a forward that cannot be captured: one that reads
        a device value on the host, say); one that ``use_cuda_graph`` asked for, or one
        under tensor parallelism (whose ranks replay in step), raises."""
        assert self.graphs is not None
        try:
            self.graphs.capture_all()
        except Exception as error:
            self.graphs.release()
            if not self.graphs.widths:
                self._decode_eagerly(error)
            else:
                logger.exception("capturing the CUDA graphs of steps that verify proposals failed: they run eagerly")
                self.graphs = self._graphs(self._decode_model, self.cache, None)
                try:
                    self.graphs.capture_all()
                except Exception as again:
                    self.graphs.release()
                    self._decode_eagerly(again)
        drafter = self.drafter
        if drafter is not None and drafter.graphs is not None:
            try:
                drafter.graphs.capture_all()
            except Exception:
                logger.exception("capturing the draft model's CUDA graphs failed: its passes run eagerly")
                drafter.graphs.release()
                drafter.graphs = None
        return self.graphs

    def _decode_eagerly(self, error: Exception) -> None:
        """After the decode graphs' capture failed with ``error``: decode steps run eagerly,
        or ``error`` is raised (see :meth:`_capture_graphs`)."""
        if self.config.use_cuda_graph is not None or tensor_parallel_layout(self.model) is not None:
            error.add_note("use_cuda_graph=False runs decode steps without CUDA graphs")
            raise error
        logger.exception(
            "capturing the decode steps' CUDA graphs failed: they run eagerly, on the model itself "
            "(use_cuda_graph=False skips the attempt)"
        )
        self.graphs = None
        self._decode_model = self.model

    def compile_sampler(self) -> None:
        """Compile the GPU sampler for the logits it will draw from: the model's, in its
        dtype and in float32 (after logits controls or a grammar's mask), and the draft's
        (float32) where its vocabulary differs; nothing on a CPU."""
        wanted = {self.spec.vocab_size: {torch.float32, self.spec.dtype}}
        if self.drafter is not None:
            wanted.setdefault(self.drafter.vocab_size, set()).add(torch.float32)
        for width, dtypes in sorted(wanted.items()):
            compile_draw(width, self.device, sorted(dtypes, key=str))

    def notify(self, *event: object) -> None:
        """A control event (``("cancel", request_id, reason)``, ``("stop", hard)``) for the other
        tensor-parallel ranks; nothing to do on one process (see :mod:`aiocb.runner.distributed`)."""

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step and wait for its results."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> PendingStep:
        """Enqueue one step's forward pass and sampling; returns without waiting."""
        if not self._kernels_loaded:  # (a runner stepped without its warm-up)
            self.load_kernels()
        drafter = self.drafter
        for cache in (self.cache,) if drafter is None else (self.cache, drafter.cache):
            cache.move_blocks(batch.copy_blocks, batch.swap_out, batch.swap_in)
        if not batch.num_rows:
            return PendingStep([], None, torch.empty(0, dtype=torch.long), None, None, None, None, None, None)
        inputs = prepare_inputs(batch, self.cache, self._transfer, self.backends, self.input_batch)
        if inputs.carry_index is not None:
            assert inputs.carry_rows is not None and self._last_tokens is not None
            inputs.input_ids.index_copy_(0, inputs.carry_index, self._last_tokens.index_select(0, inputs.carry_rows))
        sampling = inputs.sampling
        if sampling.history_carry is not None:
            assert sampling.controls is not None and sampling.controls.history_ids is not None
            assert sampling.history_carry_rows is not None and self._last_tokens is not None
            carried = self._last_tokens.index_select(0, sampling.history_carry_rows)
            sampling.controls.history_ids.index_copy_(0, sampling.history_carry, carried)
        proposed = None
        if drafter is not None and batch.drafting:
            proposed = drafter.propose(batch, inputs, self.input_batch)
        logits = self._logits(batch, inputs)
        num_sampled = batch.num_sampled + batch.num_drafts
        picked = sample(logits[:num_sampled], inputs.sampling)
        self._last_tokens = picked.tokens
        prompt: tuple[torch.Tensor | None, ...] = (None, None, None)
        if inputs.prompt_counts:
            prompt = _score_in_chunks(
                logits[num_sampled:], inputs.prompt_targets, batch.prompt_top_logprobs, self.plan.max_requests_per_batch
            )
        pending = PendingStep(
            inputs.prompt_counts,
            None,
            *(_to_host(t) for t in (picked.tokens, picked.logprobs, picked.top_ids, picked.top_logprobs, *prompt)),  # type: ignore[arg-type]
        )
        pending.proposed = _to_host(proposed)
        pending.blocked = _to_host(picked.blocked)
        if self.device.type == "cuda":
            pending.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            pending.event.record()
        return pending

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step's results and return them as lists (the prompt
        positions' alternatives as blocks of the host tensors: see ``PromptTops``)."""
        if pending.event is not None:
            pending.event.synchronize()
        prompt_logprobs: list[tuple[list[float], PromptTops | None] | None] | None = None
        if pending.prompt_counts:
            assert pending.prompt_chosen is not None
            chosen = pending.prompt_chosen.tolist()
            # (the alternatives stay tensors, each row's a view: made into lists here, a
            # step scoring 38,400 positions with 20 alternatives made 76,800 lists on this
            # thread, which set the cyclic collector off while it held the GIL, and held
            # the loop with it; bench/response_holds.py's echo)
            top_ids, top_values = pending.prompt_top_ids, pending.prompt_top_values
            prompt_logprobs = []
            start = 0
            for count in pending.prompt_counts:
                end = start + count
                tops = None if top_ids is None or top_values is None else (top_ids[start:end], top_values[start:end])
                prompt_logprobs.append((chosen[start:end], tops))
                start = end
        return StepResult(
            token_ids=pending.tokens.tolist(),
            logprobs=None if pending.logprobs is None else pending.logprobs.tolist(),
            top_logprobs=_pairs(pending.top_ids, pending.top_values),
            prompt_logprobs=prompt_logprobs,
            proposed=None if pending.proposed is None else pending.proposed.tolist(),
            blocked=None if pending.blocked is None else pending.blocked.nonzero()[:, 0].tolist() or None,
        )

    def _logits(self, batch: StepBatch, inputs: StepInputs) -> torch.Tensor:
        graphs = self.graphs
        # (a graph's tokens take the long frequencies by their positions alone)
        if graphs is not None and inputs.attention.long_rope is None:
            if graphs.eligible(batch, inputs):
                return graphs.run(inputs, batch.num_rows)
            width = graphs.width_for(batch, inputs)
            if width:
                return graphs.run_wide(inputs, batch.num_rows, width)
        # (the decode model only for steps shaped as its graphs, one sampled token a row: a
        # compiled one keeps that shape among its guards, and another recompiles it mid-serving)
        model = self._decode_model if batch.is_decode else self._varlen_model
        return attention.forward(
            model, inputs.input_ids[None], inputs.position_ids[None], inputs.logits_indices, inputs.attention
        )

    def _decode_graphs_wanted(self) -> bool:
        """Whether decode steps replay CUDA graphs (decided before the compile, which depends on it)."""
        wanted = self.config.use_cuda_graph
        if isinstance(wanted, tuple):
            varlen, wanted = wanted
        else:
            varlen = bool(wanted)
        paged = all(b in (Backend.TRITON, Backend.FLASH) for b in self.backends)
        if self.device.type != "cuda" or not paged:
            if wanted or varlen:  # (asked for by name: said where it is not done)
                logger.warning(
                    "use_cuda_graph is ignored: graphs need CUDA and in-place paged attention "
                    "(device %s, backends %s)", self.device, self.backends,
                )  # fmt: skip
            return False
        if varlen:
            logger.warning(
                "use_cuda_graph asks for graphs of mixed and prefill steps, which aiocb does not capture "
                "(only decode steps can replay graphs)"
            )
        return wanted is None or wanted

    def _graphs(
        self, model: Any, cache: PagedKVCache, speculative: SpeculativeConfig | None, *, draft: bool = False
    ) -> DecodeGraphs:
        """The CUDA graphs of ``model`` (the decode model, or the draft model with ``draft``)
        over ``cache``: of decode steps, and given ``speculative``, of steps that verify
        proposals. The draft's decode passes cover the speculating rows alone: its decode
        graphs go up to the rows that may speculate, and its pass over a verifying step
        keeps one token's logits a row."""
        blocks = self.config.max_blocks_per_request or DEFAULT_MAX_BLOCKS_PER_REQUEST
        widths, wide_rows = _wide_graphs(speculative, self.plan.max_requests_per_batch)
        # The forward closes over the model, not over self: runner -> graphs -> forward ->
        # runner would be a cycle, keeping the cache alive until a cyclic collection.
        return DecodeGraphs(
            lambda ids, pos, keep, meta: attention.forward(model, ids, pos, keep, meta),
            cache,
            self.backends,
            wide_rows if draft else self.plan.max_requests_per_batch,
            blocks,
            self.device,
            widths=widths,
            max_wide_rows=wide_rows,
            logits_per_row=draft,
        )

    def _resolve_async_batching(self) -> bool:
        wanted = self.config.use_async_batching
        if wanted is None:
            return self.graphs is not None
        return wanted


#: Rows of the graphs of steps that verify proposals when ``disable_by_batch_size`` is None
#: (steps of more rows verify without a graph): a graph holds ``rows x (1 + k)`` tokens'
#: logits, so every row bucket and width costs memory of its own.
_MOST_WIDE_ROWS = 64


def _wide_graphs(speculative: SpeculativeConfig | None, max_rows: int) -> tuple[list[int], int]:
    """The query widths and the most rows of the graphs of steps that verify proposals
    (none without speculation)."""
    if speculative is None:
        return [], 0
    assert speculative.num_speculative_tokens is not None  # (set by the config's __post_init__)
    rows = speculative.disable_by_batch_size or _MOST_WIDE_ROWS
    return query_widths(speculative.num_speculative_tokens), min(rows, max_rows)


def _freeze_what_the_compile_made() -> None:
    """A full collection, then every object alive moved out of the collector's view.

    Compiling the decode model leaves hundreds of thousands of long-lived objects
    (torch.compile's graphs, guards and generated code) that the first manager's freeze
    (:func:`aiocb.engine.manager._freeze_the_first_managers_model`) came too early for: every
    later full collection rescans them, a pause of 90-250 ms (measured on the development
    CPU after a compile) that holds the GIL, so the event loop stalls with it: the likely
    cause of the H200's loop stalls of 54 and 241 ms with the decode model compiled, 6 and
    26 ms without (bench/gpu_check.py now records the collector's pauses to tell). Frozen
    objects are still freed by reference counting, which is how a destroyed manager's
    runner and cache go (tests/engine/test_memory_release.py); the collection comes first,
    so that no garbage is frozen. Runs on the step thread, once per session whose warm-up
    compiled: its own pause falls before the first step."""
    freeze_alive_objects()


def _score_in_chunks(
    logits: torch.Tensor, targets: torch.Tensor, top: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`score` over ``rows`` rows at a time: the float32 log-softmax of a step's
    scored prompt positions (up to :func:`~aiocb.runner.memory.scored_rows`) stays within
    what the cache planner set aside for the sampled rows' float32 logits."""
    if logits.shape[0] <= rows:
        return score(logits, targets, top)
    parts = [score(logits[i : i + rows], targets[i : i + rows], top) for i in range(0, logits.shape[0], rows)]
    chosen = torch.cat([part[0] for part in parts])
    ids = [part[1] for part in parts if part[1] is not None]
    values = [part[2] for part in parts if part[2] is not None]
    return chosen, torch.cat(ids) if ids else None, torch.cat(values) if values else None


def _to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Start copying to host memory (pinned, asynchronous on CUDA)."""
    if tensor is None or tensor.device.type == "cpu":
        return tensor
    return tensor.to("cpu", non_blocking=True)


#: Rows made into Python lists in one call: a call holds the GIL from start to end, and
#: this runs on the step thread beside the event loop, whose thread takes its turn between
#: calls (a step may sample thousands of rows with 20 alternatives each).
_ROWS_BLOCK = 1024


def _rows(tensor: torch.Tensor | None) -> list[list[Any]] | None:
    """``[N, k]`` as N lists, :data:`_ROWS_BLOCK` rows a call."""
    if tensor is None:
        return None
    rows: list[list[Any]] = []
    for start in range(0, tensor.shape[0], _ROWS_BLOCK):
        rows += tensor[start : start + _ROWS_BLOCK].tolist()
    return rows


def _pairs(ids: torch.Tensor | None, values: torch.Tensor | None) -> list[list[tuple[int, float]]] | None:
    """``[N, k]`` ids and values as N lists of ``(id, value)``."""
    id_rows, value_rows = _rows(ids), _rows(values)
    if id_rows is None or value_rows is None:
        return None
    return [list(zip(i, v, strict=True)) for i, v in zip(id_rows, value_rows, strict=True)]
