"""transformers' sampling filters in its order, over the whole vocabulary, a row each.

Besides top-k, top-p and min-p (which the draws of :mod:`aiocb.runner.draw`, the C kernels
and the Triton kernel apply themselves), transformers has four rarer filters: top-h,
typical-p, epsilon and eta cutoffs. A sampled row that uses one of them is drawn here
(:func:`draw_filtered`): its scaled logits go through every filter in the order
``GenerationConfig`` builds them (temperature, top-h, top-k, top-p, min-p, typical-p,
epsilon, eta), then the Gumbel-max pick of :func:`~aiocb.runner.draw.draw_full`, with the
row's own noise. Each filter is computed as transformers' ``LogitsProcessor`` computes it,
with one value per row (a row whose value is "off" comes out bitwise unchanged), so the
distribution drawn from is transformers' exactly. These rows pay for sorts of the whole
vocabulary; rows without the rarer filters never come here.
"""

from __future__ import annotations

import torch

from aiocb.runner.draw import apply_top_k_top_p, draw_full
from aiocb.runner.logits_controls import apply_min_p

#: The columns of a row's rarer filters, ``[S, 4]`` float32, and each one's "off" value:
#: top-h (0: off; transformers' None), typical-p (1: off), epsilon and eta cutoffs (0: off).
TOP_H, TYPICAL_P, EPSILON_CUTOFF, ETA_CUTOFF = range(4)
OFF = (0.0, 1.0, 0.0, 0.0)
#: How many most likely tokens top-h looks at (transformers' ``TopHLogitsWarper.top_n``).
TOP_H_CANDIDATES = 100


def rare_filters_used(filters: torch.Tensor) -> torch.Tensor:
    """``[S]`` bool: which rows of ``filters [S, 4]`` turn any of the rarer filters on."""
    return (filters != torch.tensor(OFF, device=filters.device)).any(dim=-1)


def filter_chain(
    scaled: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    filters: torch.Tensor | None,
) -> torch.Tensor:
    """``scaled [R, V]`` (float32 logits over temperature) with every filter applied in
    transformers' order, dropped tokens at -inf. A filter no row uses may be None; rows
    whose value is off are left as they are."""
    if filters is not None:
        scaled = apply_top_h(scaled, filters[:, TOP_H])
    if top_k is not None or top_p is not None:
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    if filters is not None:
        scaled = apply_typical_p(scaled, filters[:, TYPICAL_P])
        scaled = apply_epsilon_cutoff(scaled, filters[:, EPSILON_CUTOFF])
        scaled = apply_eta_cutoff(scaled, filters[:, ETA_CUTOFF])
    return scaled


def draw_filtered(
    scaled: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None,
    filters: torch.Tensor,
) -> torch.Tensor:
    """The pick of every row of ``scaled [R, V]`` after :func:`filter_chain`: the same
    Gumbel-max pick (the same noise) as the other draws make for a row without the rarer
    filters."""
    chained = filter_chain(scaled, top_k, top_p, min_p, filters)
    return draw_full(chained, seed, offset, None, None, None)


def apply_top_h(scaled: torch.Tensor, top_h: torch.Tensor) -> torch.Tensor:
    """Top-h (transformers' ``TopHLogitsWarper``): of the row's :data:`TOP_H_CANDIDATES`
    most likely tokens, renormalised, keep them in decreasing probability while their
    running entropy is at most ``top_h`` times the whole set's (the first always). Rows
    with ``top_h`` 0 are left as they are."""
    top_n = min(TOP_H_CANDIDATES, scaled.shape[-1])
    top_logits, top_ids = scaled.topk(top_n, dim=-1, largest=True, sorted=True)
    normalised, probs = _categorical(top_logits)
    tau = _entropy(normalised, probs) * top_h
    # (a token of probability 0, -inf, adds 0 rather than NaN: it is never drawn anyway)
    terms = torch.where(probs > 0.0, -probs * probs.log(), 0.0)
    selected = terms.cumsum(dim=-1) <= tau[:, None]
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
