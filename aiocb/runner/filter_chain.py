"""transformers' sampling filters in its order, over the whole vocabulary, a row each.

Besides top-k, top-p and min-p (which the draws of :mod:`aiocb.runner.draw`, the C kernels
and the Triton kernel apply themselves), transformers has four rarer filters: top-h,
typical-p, epsilon and eta cutoffs. A sampled row that uses one of them is drawn from
:func:`filter_chain`'s logits: every filter in the order ``GenerationConfig`` builds them
(temperature, top-h, top-k, top-p, min-p, typical-p, epsilon, eta), then the Gumbel-max
pick of :func:`~aiocb.runner.draw.draw_full`, with the row's own noise. Each rarer filter
is computed op for op as transformers' ``LogitsProcessor`` computes it, with one value
per row (a row whose value is off comes out bitwise unchanged). On a CPU, rows with a
top-k run the chain over their top-k's :func:`candidates`; other rows pay for sorts of
the whole vocabulary. Rows without the rarer filters never come here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aiocb.runner.draw import apply_top_k_top_p
from aiocb.runner.logits_controls import apply_min_p

#: The columns of a row's rarer filters, ``[S, 4]`` float32, and each one's "off" value:
#: top-h (0: off; transformers' None), typical-p (1: off), epsilon and eta cutoffs (0: off).
TOP_H, TYPICAL_P, EPSILON_CUTOFF, ETA_CUTOFF = range(4)
OFF = (0.0, 1.0, 0.0, 0.0)
#: How many most likely tokens top-h looks at (transformers' ``TopHLogitsWarper.top_n``).
TOP_H_CANDIDATES = 100
#: Candidates beyond the largest top-k, for the tokens tied with a k-th largest logit.
_TIE_ROOM = 16


@dataclass(frozen=True, slots=True)
class RareFilters:
    """The rarer filters of the rows that use any (and only of those)."""

    #: ``[F]`` which of the step's sampled rows they are
    rows: torch.Tensor
    #: ``[F, 4]`` their values, a column a filter (:data:`OFF` where a row leaves it off)
    values: torch.Tensor
    #: which filters any of them turns on (read on the host: the others are skipped)
    used: tuple[bool, bool, bool, bool]

    @staticmethod
    def gather(values: torch.Tensor, sampled: torch.Tensor) -> RareFilters | None:
        """Those of ``values [S, 4]`` (host tensor) whose rows are ``sampled`` (bool) and turn
        any filter on; None when no row does."""
        on = values != torch.tensor(OFF)
        rows = (on.any(dim=-1) & sampled).nonzero()[:, 0]
        if not rows.numel():
            return None
        used = on.index_select(0, rows).any(dim=0).tolist()
        return RareFilters(rows, values.index_select(0, rows), (used[0], used[1], used[2], used[3]))

    def select(self, rows: torch.Tensor, num_rows: int) -> RareFilters | None:
        """Those of the sampled rows ``rows`` (of ``num_rows``, increasing), numbered as
        ``rows`` numbers them; None when none of them uses one. (On a GPU, the count read
        is a wait for the device: only batches with rows that use a rarer filter pay it.)"""
        place = torch.full((num_rows,), -1, dtype=torch.long, device=rows.device)
        place.index_copy_(0, rows, torch.arange(len(rows), device=rows.device))
        numbered = place.index_select(0, self.rows)
        kept = (numbered >= 0).nonzero()[:, 0]
        if not kept.numel():
            return None
        return RareFilters(numbered.index_select(0, kept), self.values.index_select(0, kept), self.used)


def candidates(
    scaled: torch.Tensor, top_k: torch.Tensor | None, used: tuple[bool, bool, bool, bool]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """On a CPU, each row's largest logits ``(values, ids)`` (``[R, width]``, by decreasing
    logit) when they hold every token the row's top-k can keep: then :func:`filter_chain`
    over them leaves what it leaves over the whole row (every other token is -inf after
    top-k, and top-h, before it, reads the 100 largest), without sorting the vocabulary.
    None where that does not hold (a row without top-k, a tie with a k-th largest logit
    that may go on past them) or brings nothing, and on other devices (the top-k's width
    is read on the host)."""
    if top_k is None or scaled.device.type != "cpu":
        return None
    vocab = scaled.shape[-1]
    ks = top_k.tolist()
    if not ks or min(ks) <= 0 or max(ks) >= vocab:
        return None
    width = max(ks) + _TIE_ROOM
    if used[TOP_H]:
        width = max(width, TOP_H_CANDIDATES)
    if 4 * width > vocab:
        return None
    values, ids = scaled.topk(width, dim=-1)
    kth = values.gather(1, (top_k - 1)[:, None])
    if bool((values[:, -1] == kth[:, 0]).any()):
        return None
    return values, ids


def filter_chain(
    scaled: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    values: torch.Tensor | None = None,
    used: tuple[bool, bool, bool, bool] = (False, False, False, False),
) -> torch.Tensor:
    """``scaled [R, V]`` (float32 logits over temperature) with every filter applied in
    transformers' order, dropped tokens at -inf. A filter no row uses may be None (for the
    rarer ones, ``values [R, 4]`` and ``used``, which of them to apply); rows whose value is
    off are left as they are."""
    if values is not None and used[TOP_H]:
        scaled = apply_top_h(scaled, values[:, TOP_H])
    if top_k is not None or top_p is not None:
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    if values is not None:
        for column, apply in _AFTER_MIN_P:
            if used[column]:
                scaled = apply(scaled, values[:, column])
    return scaled


def apply_top_h(scaled: torch.Tensor, top_h: torch.Tensor) -> torch.Tensor:
    """Top-h (transformers' ``TopHLogitsWarper``): of the row's :data:`TOP_H_CANDIDATES`
    most likely tokens, renormalised, keep them in decreasing probability while their
    running entropy is at most ``top_h`` times the whole set's (the first always). Rows
    with ``top_h`` 0 are left as they are."""
    top_n = min(TOP_H_CANDIDATES, scaled.shape[-1])
    top_logits, top_ids = scaled.topk(top_n, dim=-1, largest=True, sorted=True)
    normalised, probs = _categorical(top_logits)
    tau = _entropy(normalised, probs) * top_h
    terms = torch.where(probs > 0.0, -probs * probs.log(), 0.0)
    # (transformers' NaN terms for tokens of probability 0 leave them out: so here)
    selected = (terms.cumsum(dim=-1) <= tau[:, None]) & (probs > 0.0)
    selected[:, 0] = True
    keep = torch.zeros_like(scaled, dtype=torch.bool).scatter_(1, top_ids, selected)
    drop = ~keep & (top_h > 0.0)[:, None]
    return scaled.masked_fill(drop, float("-inf"))


def apply_typical_p(scaled: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (transformers' ``TypicalLogitsWarper``): keep the tokens
    whose surprisal is closest to the row's entropy, until they hold ``mass`` of the
    probability (ties with the last one kept too; the closest always). Rows with ``mass``
    1 are left as they are."""
    log_probs = scaled.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum(dim=-1, keepdim=True)
    shifted = ((-log_probs) - entropy).abs()
    sorted_shifted, order = shifted.sort(dim=-1)
    cumulative = scaled.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass[:, None]).sum(dim=1).clamp_(max=scaled.shape[-1] - 1)
    drop_sorted = sorted_shifted > sorted_shifted.gather(1, last[:, None])
    drop_sorted[:, 0] = False
    drop = drop_sorted.scatter(1, order, drop_sorted) & (mass < 1.0)[:, None]
    return scaled.masked_fill(drop, float("-inf"))


def apply_epsilon_cutoff(scaled: torch.Tensor, epsilon: torch.Tensor) -> torch.Tensor:
    """Epsilon sampling (transformers' ``EpsilonLogitsWarper``): drop the tokens of
    probability below ``epsilon``, but never the most likely. Rows with ``epsilon`` 0 are
    left as they are."""
    probs = scaled.softmax(dim=-1)
    drop = (probs < epsilon[:, None]) & (scaled < scaled.amax(dim=-1, keepdim=True))
    return scaled.masked_fill(drop, float("-inf"))


def apply_eta_cutoff(scaled: torch.Tensor, epsilon: torch.Tensor) -> torch.Tensor:
    """Eta sampling (transformers' ``EtaLogitsWarper``): drop the tokens of probability
    below ``min(epsilon, sqrt(epsilon) * exp(-entropy))``, but never the most likely. Rows
    with ``epsilon`` 0 are left as they are."""
    probs = scaled.softmax(dim=-1)
    eta = torch.minimum(epsilon, epsilon.sqrt() * torch.exp(-_entropy(*_categorical(scaled))))
    drop = (probs < eta[:, None]) & (scaled < scaled.amax(dim=-1, keepdim=True))
    return scaled.masked_fill(drop, float("-inf"))


def _categorical(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.distributions.Categorical(logits=logits)``'s normalised logits and
    probabilities, computed as it computes them (the filters' thresholds come out the same
    to the last bit)."""
    normalised = logits - logits.logsumexp(dim=-1, keepdim=True)
    return normalised, normalised.softmax(dim=-1)


def _entropy(normalised: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``[R]``: each row's entropy, as ``Categorical.entropy`` computes it (a -inf logit
    counts as the dtype's lowest, so a token of probability 0 adds 0, not NaN)."""
    lowest = torch.finfo(normalised.dtype).min
    return -(normalised.clamp(min=lowest) * probs).sum(dim=-1)


#: The rarer filters transformers applies after min-p, in its order.
_AFTER_MIN_P = (
    (TYPICAL_P, apply_typical_p),
    (EPSILON_CUTOFF, apply_epsilon_cutoff),
    (ETA_CUTOFF, apply_eta_cutoff),
)
