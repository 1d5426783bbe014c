"""Per-request generation controls on a step's logits: biases, penalties, bans, allow-lists, min-p.

The device side works on the ``[S, V]`` float32 logits of the sampled rows, all rows at
once: each control arrives as flat ``(row, token id)`` lists or ``[S]`` parameters, so a
batch mixing requests with and without a control costs one pass per control, not one per
request. Stages no row uses are skipped, and a row that uses none of them comes out
bit-identical. Semantics and order follow transformers' processors (``sequence_bias``,
``repetition_penalty``, ``bad_words_ids`` / ``min_new_tokens``, ``min_p``), with the OpenAI
presence and frequency penalties next to the repetition penalty, where vLLM applies them.

Every token id given to :func:`apply_controls` must be below ``V``; the host side, which
builds the lists, drops ids the model cannot produce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LogitsControls:
    """Per-step tensors of the controls that some row of the step uses; None = no row uses it."""

    # additive biases, flat: logits[bias_rows[i], bias_ids[i]] += bias_values[i] (duplicates accumulate)
    bias_rows: torch.Tensor | None = None  # [N] int64
    bias_ids: torch.Tensor | None = None  # [N] int64
    bias_values: torch.Tensor | None = None  # [N] float32
    # token history for penalties, flat (row, token id); is_output says whether the token
    # was generated (True) or is in the prompt (False)
    history_rows: torch.Tensor | None = None  # [H] int64
    history_ids: torch.Tensor | None = None  # [H] int64
    history_is_output: torch.Tensor | None = None  # [H] bool
    repetition_penalty: torch.Tensor | None = None  # [S] float32, 1.0 = off; transformers, prompt + output
    presence_penalty: torch.Tensor | None = None  # [S] float32, 0 = off; OpenAI, output tokens only
    frequency_penalty: torch.Tensor | None = None  # [S] float32, 0 = off; OpenAI, output tokens only
    # banned tokens, flat (row, token id): set to -inf
    ban_rows: torch.Tensor | None = None  # [B] int64
    ban_ids: torch.Tensor | None = None  # [B] int64
    # allowed tokens: rows with restrict_rows[row] True keep only their (allow_rows, allow_ids)
    # entries, everything else -inf
    restrict_rows: torch.Tensor | None = None  # [S] bool
    allow_rows: torch.Tensor | None = None  # [A] int64
    allow_ids: torch.Tensor | None = None  # [A] int64


def apply_controls(logits: torch.Tensor, controls: LogitsControls) -> torch.Tensor:
    """``logits [S, V]`` (float32) with the rows' controls applied, in transformers' order.

    Biases, then the repetition penalty, then the frequency and presence penalties, then
    bans, then allow-lists. The input is never modified (the raw logits also give the
    log-probabilities); the result may be a new tensor.
    """
    c = controls
    if c.bias_rows is not None and c.bias_ids is not None and c.bias_values is not None:
        logits = logits.index_put((c.bias_rows, c.bias_ids), c.bias_values, accumulate=True)
    if c.history_rows is not None and c.history_ids is not None:
        if c.repetition_penalty is not None:
            logits = _repetition_penalty(logits, c.history_rows, c.history_ids, c.repetition_penalty)
        if c.history_is_output is not None and (c.frequency_penalty is not None or c.presence_penalty is not None):
            logits = _openai_penalties(
                logits, c.history_rows, c.history_ids, c.history_is_output, c.frequency_penalty, c.presence_penalty
            )
    if c.ban_rows is not None and c.ban_ids is not None:
        logits = logits.index_put((c.ban_rows, c.ban_ids), _scalar(float("-inf"), logits.dtype, logits.device))
    if c.restrict_rows is not None and c.allow_rows is not None and c.allow_ids is not None:
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed.index_put_((c.allow_rows, c.allow_ids), _scalar(True, torch.bool, logits.device))
        logits = logits.masked_fill(c.restrict_rows[:, None] & ~allowed, float("-inf"))
    return logits


def _scalar(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d device tensor made by a fill, not a host copy: no sync, safe under graph capture."""
    return torch.full((), value, dtype=dtype, device=device)


def _repetition_penalty(
    logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """transformers' ``RepetitionPenaltyLogitsProcessor`` over each row's history.

    Like transformers, this gathers the history entries' logits, penalises them and
    scatters them back, which touches ``H`` entries rather than ``S * V``. A token that
    occurs several times is penalised once: every copy is computed from the same original
    logit, so the duplicate writes agree whatever order they land in.
    """
    score = logits[rows, ids]
    p = penalty[rows]
    # A negative logit is multiplied so that a penalty above 1 lowers it in both cases.
    return logits.index_put((rows, ids), torch.where(score < 0, score * p, score / p))


def _openai_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    ids: torch.Tensor,
    is_output: torch.Tensor,
    frequency: torch.Tensor | None,
    presence: torch.Tensor | None,
) -> torch.Tensor:
    """OpenAI's ``logit - frequency * count - presence * (count > 0)`` over the output tokens.

    Prompt entries are counted with weight 0 rather than filtered out: a boolean selection
    has a data-dependent size and would make the host wait for the device. Subtracting a
    zero penalty leaves a row's logits bitwise unchanged, so rows with the penalties off
    need no masking.
    """
    counts = torch.zeros_like(logits).index_put_((rows, ids), is_output.to(logits.dtype), accumulate=True)
    if frequency is not None:
        logits = logits - frequency[:, None] * counts
    if presence is not None:
        logits = logits - presence[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """transformers' ``MinPLogitsWarper`` (``min_tokens_to_keep=1``) per row of ``logits [S, V]``.

    Meant for the logits after temperature, top-k and top-p, as in transformers: a token
    whose probability is below ``min_p * (the row's top probability)`` becomes -inf.
    ``min_p [S]`` (float32) is 0 for rows without it, whose logits come out bitwise
    unchanged (``log(0)`` is -inf, which every difference passes).

    The test is the ratio's log, ``logit - top logit < log(min_p)``: the form the draw
    kernels use (they never make the probabilities), so that a row drawn here and one
    drawn by a kernel keep the same tokens, and processed log-probabilities never call a
    drawn token impossible. transformers compares the softmax's probabilities, whose
    rounding differs from it only for a token within a float32 step of the cutoff. Its
    forcing the top token back in is a no-op here: with ``min_p`` in ``[0, 1]`` (which the
    caller validates) the top token's difference, 0, passes.
    """
    below = logits - logits.amax(dim=-1, keepdim=True) < min_p.log()[:, None]
    return logits.masked_fill(below, float("-inf"))
