"""Batched per-request sampling: controls, greedy, temperature and transformers' filters.

Randomness comes from a counter-based hash of ``(request seed, token index, vocab id)``
rather than a shared generator, so a request's samples depend on its seed alone, not on
which requests share its batch or in which order, and no host synchronisation is needed
on a GPU. A token is drawn with the Gumbel-max trick (:mod:`aiocb.runner.draw`): on a CPU
from each row's largest logits where they suffice, on a GPU by a Triton kernel's
rejection passes over the vocabulary (:mod:`aiocb.runner.triton_sampler`), or over the
sorted vocabulary without Triton; all give the same pick. Rows that use one of the rarer
filters (top-h, typical-p, epsilon or eta cutoffs) are drawn from
:mod:`aiocb.runner.filter_chain`'s logits, with the same noise.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from aiocb.runner.argmax import argmax_rows
from aiocb.runner.draw import draw, draw_full
from aiocb.runner.filter_chain import OFF, RareFilters, candidates, filter_chain
from aiocb.runner.logits_controls import LogitsControls, apply_controls
from aiocb.runner.noise import gumbel_at, seed_key

logger = logging.getLogger(__name__)


class _SamplingRow(Protocol):
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    offset: int
    logprobs: bool
    top_logprobs: int
    #: the rarer filters' values (top-h, typical-p, epsilon and eta cutoffs), None when off
    filters: tuple[float, float, float, float] | None


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one step, as tensors on the device."""

    temperature: torch.Tensor  # [S] float32, 0 for greedy rows
    top_k: torch.Tensor  # [S] int64, 0 = off
    top_p: torch.Tensor  # [S] float32, 1 = off
    seed: torch.Tensor  # [S] int64, 32-bit values
    offset: torch.Tensor  # [S] int64, tokens the request generated before
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_logprobs: bool
    #: the most alternatives any row asked for (0: none)
    max_top_logprobs: int
    #: the largest top_k of a sampled row (0: none), which bounds a top-k selection's width
    max_top_k: int = 0
    #: whether any row is greedy (False spares a GPU draw the argmax of every row)
    any_greedy: bool = True
    #: [S] float32, 0 = off; None when no sampled row uses min-p
    min_p: torch.Tensor | None = None
    #: the rarer filters (:mod:`aiocb.runner.filter_chain`) of the sampled rows that use
    #: any; None when none does
    rare: RareFilters | None = None
    #: [S] bool: rows whose logprobs are of the distribution drawn from (after controls,
    #: masks, temperature and filters), not the raw one; None when no row's are
    processed_logprobs: torch.Tensor | None = None
    #: biases, penalties, bans and allow-lists; None when no row uses one
    controls: LogitsControls | None = None
    #: entries of ``controls.history_ids`` still being sampled by the previous step, and
    #: which of its sampled rows each comes from (async batching)
    history_carry: torch.Tensor | None = None
    history_carry_rows: torch.Tensor | None = None
    #: constrained decoding: the tokens each constrained row's grammar allows (int32 bits),
    #: and which rows those are
    bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None

    @staticmethod
    def host_tensors(rows: Sequence[_SamplingRow]) -> dict[str, torch.Tensor]:
        """The per-row parameters as host tensors, named for :meth:`from_device`."""
        host = {
            "temperature": torch.tensor([0.0 if _greedy(r) else r.temperature for r in rows], dtype=torch.float32),
            "top_k": torch.tensor([r.top_k for r in rows], dtype=torch.long),
            "top_p": torch.tensor([r.top_p for r in rows], dtype=torch.float32),
            "seed": torch.tensor([seed_key(r.seed) for r in rows], dtype=torch.long),
            "offset": torch.tensor([r.offset for r in rows], dtype=torch.long),
        }
        if any(r.min_p > 0.0 and not _greedy(r) for r in rows):
            host["min_p"] = torch.tensor([0.0 if _greedy(r) else r.min_p for r in rows], dtype=torch.float32)
        if any(r.filters is not None and not _greedy(r) for r in rows):
            values = [OFF if r.filters is None or _greedy(r) else r.filters for r in rows]
            host["filters"] = torch.tensor(values, dtype=torch.float32)
        return host

    @classmethod
    def from_rows(cls, rows: Sequence[_SamplingRow], device: torch.device) -> SamplingTensors:
        """Gather the sampled rows' parameters onto ``device``."""
        host = cls.host_tensors(rows)
        params = cls.from_device({name: t.to(device) for name, t in host.items()}, rows)
        if "filters" in host:
            rare = RareFilters.gather(host["filters"], host["temperature"] != 0.0)
            assert rare is not None
            params.rare = RareFilters(rare.rows.to(device), rare.values.to(device), rare.used)
        return params

    @classmethod
    def from_device(cls, tensors: dict[str, torch.Tensor], rows: Sequence[_SamplingRow]) -> SamplingTensors:
        """Wrap :meth:`host_tensors` moved to the device, with the rows' batch-wide flags."""
        greedy = [_greedy(r) for r in rows]
        return cls(
            temperature=tensors["temperature"],
            top_k=tensors["top_k"],
            top_p=tensors["top_p"],
            seed=tensors["seed"],
            offset=tensors["offset"],
            all_greedy=all(greedy),
            any_top_k=any(r.top_k > 0 for r, g in zip(rows, greedy, strict=True) if not g),
            any_top_p=any(r.top_p < 1.0 for r, g in zip(rows, greedy, strict=True) if not g),
            any_logprobs=any(r.logprobs or r.top_logprobs for r in rows),
            max_top_logprobs=max((r.top_logprobs for r in rows), default=0),
            max_top_k=max((r.top_k for r, g in zip(rows, greedy, strict=True) if not g), default=0),
            any_greedy=any(greedy),
            min_p=tensors.get("min_p"),
            controls=controls_from_tensors(tensors),
            history_carry=tensors.get("c_history_carry"),
            history_carry_rows=tensors.get("c_history_carry_rows"),
        )

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        """The parameters of ``rows`` (a device index, increasing) alone, without logprobs,
        controls or grammar masks (the first proposals of a draft model, which the target's
        own draw then checks: a proposal drawn without those is only less likely to be
        accepted; the batch-wide flags stay the batch's, which may only make the draw take a
        more general path)."""
        return dataclasses.replace(
            self,
            temperature=self.temperature.index_select(0, rows),
            top_k=self.top_k.index_select(0, rows),
            top_p=self.top_p.index_select(0, rows),
            seed=self.seed.index_select(0, rows),
            offset=self.offset.index_select(0, rows),
            any_logprobs=False,
            max_top_logprobs=0,
            min_p=None if self.min_p is None else self.min_p.index_select(0, rows),
            rare=None if self.rare is None else self.rare.select(rows, len(self.temperature)),
            processed_logprobs=None,
            controls=None,
            history_carry=None,
            history_carry_rows=None,
            bitmask=None,
            bitmask_rows=None,
        )


def controls_from_tensors(tensors: dict[str, torch.Tensor]) -> LogitsControls | None:
    """The ``c_*`` tensors of :func:`~aiocb.runner.inputs.controls_host_tensors` as controls."""
    if not any(name.startswith("c_") for name in tensors):
        return None
    return LogitsControls(**{f.name: tensors.get(f"c_{f.name}") for f in dataclasses.fields(LogitsControls)})


@dataclass(slots=True)
class Sampled:
    """One step's picks: ``tokens [S]``; with logprobs, theirs ``[S]`` and the top ``[S, k]``."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    #: [S] bool, rows whose controls or grammar mask left no token (their pick is
    #: meaningless); None when no row has either
    blocked: torch.Tensor | None = None


def _greedy(row: _SamplingRow) -> bool:
    return row.temperature == 0.0


def sample(logits: torch.Tensor, params: SamplingTensors) -> Sampled:
    """Pick one token per row of ``logits [S, V]`` (the model's dtype).

    When any row asked for them, also the log-probabilities of the picks and the most
    likely alternatives, under the raw distribution (log-softmax of ``logits``), or for
    the rows of ``params.processed_logprobs`` under the distribution drawn from.
    """
    raw = logits
    drawn_on_cpu = not params.all_greedy and logits.device.type == "cpu"
    if params.controls is not None or params.bitmask is not None or drawn_on_cpu:
        # (no float copy for greedy rows alone, whose argmax is the same in any float dtype,
        # nor for a device draw, which reads the model's dtype itself)
        logits = logits.float()
    if params.controls is not None:
        logits = apply_controls(logits, params.controls)
    if params.bitmask is not None:
        from aiocb.structured import apply_bitmask  # (imports xgrammar: only where it is used)

        assert params.bitmask_rows is not None
        if logits is raw:
            logits = logits.clone()  # (logprobs are of the raw distribution)
        apply_bitmask(logits, params.bitmask, params.bitmask_rows)
    if params.all_greedy:
        tokens = argmax_rows(logits)
    elif logits.device.type == "cpu":
        rows = (params.temperature != 0.0).nonzero()[:, 0]
        every = rows.numel() == logits.shape[0]

        def take(t: torch.Tensor) -> torch.Tensor:
            return t if every else t.index_select(0, rows)

        min_p = None if params.min_p is None else take(params.min_p)
        temperature, seed, offset = take(params.temperature), take(params.seed), take(params.offset)
        drawn = draw(take(logits), temperature, seed, offset, take(params.top_k), take(params.top_p), min_p)
        if every:
            tokens = drawn
        else:
            tokens = argmax_rows(logits)
            tokens[rows] = drawn
    else:
        tokens = draw_on_device(logits, params)
    rare = None if params.rare is None else _rare_chain(logits, params, params.rare)
    if rare is not None:
        # (the same Gumbel-max pick, with the row's own noise, over the whole vocabulary or
        # over the candidates outside which every token is -inf)
        assert params.rare is not None
        rows = params.rare.rows
        chained, ids = rare
        seed, offset = params.seed.index_select(0, rows), params.offset.index_select(0, rows)
        if ids is None:
            drawn = draw_full(chained, seed, offset, None, None, None)
        else:
            drawn = ids.gather(1, (chained + gumbel_at(seed, offset, ids)).argmax(dim=-1, keepdim=True))[:, 0]
        tokens.index_copy_(0, rows, drawn)
    result = Sampled(tokens)
    if params.controls is not None or params.bitmask is not None:
        # Bans, allow-lists and n-gram bans may leave a row nothing (a pick of every
        # token at -inf, whatever path drew it); a top-k, top-p or min-p filter never does.
        result.blocked = logits.gather(1, tokens[:, None])[:, 0] == float("-inf")
    if params.any_logprobs:
        scored = raw if params.processed_logprobs is None else _drawn_from(raw, logits, params, rare)
        result.logprobs, result.top_ids, result.top_logprobs = score(scored, tokens, params.max_top_logprobs)
    return result


def _rare_chain(
    logits: torch.Tensor, params: SamplingTensors, rare: RareFilters
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits the rows of ``rare`` (sampled rows that use one of the rarer filters) are
    drawn from: ``logits`` (after controls and masks) over their temperature, with every
    filter of theirs, float32; over the whole vocabulary (ids None), or over the rows'
    :func:`~aiocb.runner.filter_chain.candidates` and their ids."""
    rows = rare.rows

    def take(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, rows)

    scaled = take(logits).float() / take(params.temperature)[:, None]
    top_k = take(params.top_k) if params.any_top_k else None
    top_p = take(params.top_p) if params.any_top_p else None
    min_p = None if params.min_p is None else take(params.min_p)
    block = candidates(scaled, top_k, rare.used)
    if block is None:
        return filter_chain(scaled, top_k, top_p, min_p, rare.values, rare.used), None
    values, ids = block
    return filter_chain(values, top_k, top_p, min_p, rare.values, rare.used), ids


def _drawn_from(
    raw: torch.Tensor,
    logits: torch.Tensor,
    params: SamplingTensors,
    rare: tuple[torch.Tensor, torch.Tensor | None] | None,
) -> torch.Tensor:
    """The logits of the distributions the rows were drawn from, float32, for the rows of
    ``params.processed_logprobs`` (the others' raw logits): ``logits`` (after controls and
    masks) over the row's temperature, with its filters, as transformers' logits
    processors make them (``rare``: :func:`_rare_chain`'s, which the draw made). A greedy
    row's is its controlled logits."""
    assert params.processed_logprobs is not None
    drawn = params.temperature != 0.0
    processed = logits.float() / torch.where(drawn, params.temperature, 1.0)[:, None]
    top_k = torch.where(drawn, params.top_k, 0) if params.any_top_k else None
    top_p = torch.where(drawn, params.top_p, 1.0) if params.any_top_p else None
    processed = filter_chain(processed, top_k, top_p, params.min_p)  # (min-p is 0, off, for greedy rows)
    if rare is not None:
        assert params.rare is not None
        chained, ids = rare
        if ids is not None:  # (the candidates' logits in place, every other token -inf)
            chained = torch.full_like(processed[: ids.shape[0]], float("-inf")).scatter_(1, ids, chained)
        processed = processed.index_copy(0, params.rare.rows, chained)
    return torch.where(params.processed_logprobs[:, None], processed, raw.float())


#: whether the Triton sampler failed once in this process (it is not tried again)
_kernel_failed = False


def draw_on_device(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """:func:`sample`'s pick on a GPU: no branch on the data, as the host must not wait for
    the device. The Triton kernel where it runs, else :func:`~aiocb.runner.draw.draw_full`.

    ``logits`` may be in the model's dtype: the kernel upcasts them as it reads them (a
    float32 copy of 1,024 rows of 151,936 would write 622 MB a step, then be read). It also
    runs on CPU tensors, with the kernel in Triton's interpreter when that is on.
    """
    from aiocb.runner import triton_sampler  # (imports triton: only where this path runs)

    global _kernel_failed
    greedy = params.temperature == 0.0 if params.any_greedy else None
    temperature = params.temperature if greedy is None else torch.where(greedy, 1.0, params.temperature)
    sampled = None
    readable = logits.dtype in triton_sampler.LOGITS_DTYPES
    if not _kernel_failed and readable and triton_sampler.is_available(logits.device):
        top_k = params.top_k if params.any_top_k else None
        top_p = params.top_p if params.any_top_p else None
        try:
            sampled = triton_sampler.triton_draw(
                logits, temperature, params.seed, params.offset, top_k, top_p, params.min_p, params.max_top_k
            )
        except Exception:  # (a kernel that does not compile here): the same picks, slower
            logger.exception("the Triton sampler failed; sampling over the sorted vocabulary from now on")
            _kernel_failed = True
    if sampled is None:
        filtered = params.any_top_k or params.any_top_p
        top_k, top_p = (params.top_k, params.top_p) if filtered else (None, None)
        scaled = logits.float() / temperature[:, None]
        sampled = draw_full(scaled, params.seed, params.offset, top_k, top_p, params.min_p)
    return sampled if greedy is None else torch.where(greedy, logits.argmax(dim=-1), sampled)


def compile_draw(vocab: int, device: torch.device, dtypes: Iterable[torch.dtype]) -> None:
    """Compile the Triton draw kernel for logits ``vocab`` wide of each of ``dtypes`` where
    :func:`draw_on_device` will run it (on CUDA), so that no sampled step waits for the
    compiler; a kernel that does not compile here is given up on now, as
    :func:`draw_on_device` would. A dtype the kernel does not read (float64) is left out:
    :func:`draw_on_device` draws from such logits without it."""
    global _kernel_failed
    if device.type != "cuda" or _kernel_failed:
        return
    from aiocb.runner import triton_sampler  # (imports triton: only where this path runs)

    if not triton_sampler.is_available(device):
        return
    try:
        triton_sampler.compile_draw(vocab, device, [d for d in dtypes if d in triton_sampler.LOGITS_DTYPES])
    except Exception:
        logger.exception("the Triton sampler failed to compile; sampling over the sorted vocabulary")
        _kernel_failed = True


def score(
    logits: torch.Tensor, targets: torch.Tensor, top: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probabilities of ``targets [N]`` under ``logits [N, V]``, and the ``top`` best."""
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    if top <= 0:
        return chosen, None, None
    values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
    return chosen, ids, values
