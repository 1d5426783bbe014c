"""Drawing a token per row with the Gumbel-max trick, over candidates or over the vocabulary.

A row's token is ``argmax(logits / T + Gumbel noise)`` over the tokens that survive its
top-k, top-p and min-p (transformers' filters, in that order), with the noise hashed from
``(seed, offset, vocab id)`` (:mod:`aiocb.runner.noise`). Argmax picks are robust: the
logits of one request differ in their last bits with the shape of its batch, and a pick
only changes when two scores tie to those bits.

:func:`draw_full` computes it over the whole vocabulary (with one sort for top-k and
top-p): on a GPU, where no branch may depend on the data (the host would wait for the
device), and on a CPU for the rows without those filters and the rows the candidates do
not settle (there the noise comes a block of the vocabulary at a time,
:func:`~aiocb.runner.noise.gumbel_argmax`).

:func:`draw` computes the same pick of a top-k or top-p row from its :data:`CANDIDATES`
largest logits (one partial ``topk``, noise for those ids only): the tokens a filter
keeps are a prefix of them by decreasing logit, and a token outside them cannot win when
the best candidate's score beats the largest logit left out plus the largest noise there
is. Rows for which neither holds (a flat nucleus, a top-k larger than the candidates) are
redone by :func:`draw_full`. It looks at the data to decide, so it is the CPU's sampler.
Where they are built, C kernels make the same picks (:mod:`aiocb.runner.native`).
"""

from __future__ import annotations

import torch

from aiocb.runner import native
from aiocb.runner.argmax import argmax_rows
from aiocb.runner.logits_controls import apply_min_p
from aiocb.runner.noise import GUMBEL_BOUND, gumbel_argmax, gumbel_at, gumbel_noise

#: How many largest logits a row's draw looks at before falling back to the vocabulary.
CANDIDATES = 1024
#: Candidates beyond a top-k, for the tokens tied with its k-th largest logit.
_TIE_ROOM = 16


def draw_full(
    scaled: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """The pick of every row of ``scaled [R, V]`` (logits over temperature); a filter that
    no row uses may be None."""
    if top_k is not None or top_p is not None:
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    if scaled.device.type == "cpu":
        return gumbel_argmax(scaled, seed, offset)  # (the same pick, without [R, V] noise)
    noise = gumbel_noise(seed, offset, scaled.shape[-1])
    return argmax_rows(scaled + noise)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set every logit outside a row's top-k, then outside its top-p nucleus, to -inf.

    As transformers' filters: top-k keeps every token at least the k-th largest logit
    (ties included), top-p the most likely tokens while the mass before them is below
    ``top_p`` (the first always). Tokens tied with the nucleus's last are kept too: a
    sort's order among equal logits is no reason to keep one and drop another.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        # The most likely token always stays, whatever top_p is; a row of top_p 1 keeps all.
        inside = (mass_before < top_p[:, None]) | (ranks == 0) | (top_p[:, None] >= 1.0)
        floor = torch.where(inside, sorted_logits, float("inf")).amin(dim=-1, keepdim=True)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < floor, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


_UNFILTERED, _KERNEL, _CANDIDATES = range(3)


def draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """The pick of every row of ``logits [R, V]`` (float32) at ``temperature`` (``[R]``,
    positive), as :func:`draw_full` makes it, from the rows' largest logits where they suffice.

    On a CPU, where the C kernels are built (:mod:`aiocb.runner.native`: the same picks, two
    to ten times faster than the torch ops here), every row goes to them. Otherwise rows without top-k
    or top-p take :func:`draw_full` (its noise a block of the vocabulary at a time), and the
    rest draw from :data:`CANDIDATES` largest logits in torch ops, and a row those do not
    settle (one without a clear favourite) pays for both.
    """
    rows, vocab = logits.shape
    kernel = native.library() if logits.device.type == "cpu" else None
    filtered = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)
    way = torch.where(filtered, _CANDIDATES if kernel is None else _KERNEL, _UNFILTERED)
    counts = torch.bincount(way, minlength=3).tolist()

    def draw_one_way(
        way: int,
        x: torch.Tensor,
        t: torch.Tensor,
        s: torch.Tensor,
        o: torch.Tensor,
        k: torch.Tensor,
        p: torch.Tensor,
        m: torch.Tensor | None,
    ) -> torch.Tensor:
        if way == _UNFILTERED:
            if kernel is not None:
                return native.draw_whole(kernel, x, t, None if m is None else m.log(), s, o)
            return draw_full(x / t[:, None], s, o, None, None, m)
        if way == _KERNEL:
            assert kernel is not None
            return native.draw_filtered(kernel, x, t, k, p, None if m is None else m.log(), s, o)
        return _draw_from_candidates(x, t, s, o, k, p, m)

    columns = (logits, temperature, seed, offset, top_k, top_p)
    if rows in counts:  # (one way for every row)
        return draw_one_way(counts.index(rows), *columns, min_p)
    tokens = torch.zeros_like(top_k)
    for each_way, count in enumerate(counts):
        if count:
            picked = (way == each_way).nonzero()[:, 0]
            x, t, s, o, k, p = (column.index_select(0, picked) for column in columns)
            tokens[picked] = draw_one_way(each_way, x, t, s, o, k, p, None if min_p is None else min_p[picked])
    return tokens


def _draw_from_candidates(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`draw` from the rows' :data:`CANDIDATES` largest logits where they suffice."""
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    # As few candidates as the rows' top-k allow (a row without one needs the most), and
    # a few more, for the tokens tied with the k-th.
    width = min(vocab, CANDIDATES, int(torch.where(top_k > 0, top_k, CANDIDATES).max()) + _TIE_ROOM)
    values, ids = logits.topk(width, dim=-1)  # (a row's order over its temperature too)
    scaled = values / temperature[:, None]
    ranks = torch.arange(width, device=logits.device)
    # Every token tied with the k-th stays (as in transformers).
    kth = values.gather(1, (k.clamp(max=width) - 1)[:, None])
    in_k = (values >= kth) | (k > width)[:, None]
    keep = in_k
    nucleus = top_p < 1.0
    if bool(nucleus.any()):
        # The softmax over the top-k set: over the candidates when the set lies within
        # them, else over the whole row.
        normaliser = torch.where(in_k, scaled, float("-inf")).logsumexp(-1, keepdim=True)
        whole = ((k >= vocab) & nucleus).nonzero()[:, 0]
        if whole.numel():
            rows = logits.index_select(0, whole) / temperature.index_select(0, whole)[:, None]
            normaliser[whole] = rows.logsumexp(-1, keepdim=True)
        probs = torch.where(in_k, (scaled - normaliser).exp(), 0.0)
        mass_before = probs.cumsum(-1) - probs
        inside = in_k & ((mass_before < top_p[:, None]) | (ranks[None, :] == 0) | ~nucleus[:, None])
        # (and every token tied with the nucleus's last)
        keep = keep & (scaled >= torch.where(inside, scaled, float("inf")).amin(-1, keepdim=True))
    if min_p is not None:
        # min-p compares probabilities with the row's largest: a difference of logits.
        keep = keep & ((scaled - scaled[:, :1]) >= torch.log(min_p)[:, None])
    tokens = torch.zeros_like(top_k)
    redo = torch.zeros_like(nucleus)
    if width < vocab:
        # A nucleus over a top-k set larger than the candidates needs that set's softmax,
        # and a tie at the k-th that reaches the last candidate may go on past them.
        # (Not a tie of masked tokens, -inf: those are never drawn.)
        tie_beyond = (k <= width) & (values[:, -1] == kth[:, 0]) & (kth[:, 0] > float("-inf"))
        redo = ((k > width) & (k < vocab) & nucleus) | tie_beyond
        # The kept tokens may go on past the candidates: then a pick stands only if no token
        # left out (logit at most the last candidate's) can beat it. Rows where it almost
        # surely would not stand (the best score falls about this far short of the bound
        # less than once in fifty) go to the full draw without the candidates' noise.
        beyond = keep[:, -1] & (k > width)
        expected_best = torch.where(keep, scaled, float("-inf")).logsumexp(-1)
        redo |= beyond & (expected_best + 4.0 < scaled[:, -1] + GUMBEL_BOUND)
    tried = (~redo).nonzero()[:, 0]
    if tried.numel():
        noise = gumbel_at(seed.index_select(0, tried), offset.index_select(0, tried), ids.index_select(0, tried))
        kept, candidates = keep.index_select(0, tried), scaled.index_select(0, tried)
        best_score, best = torch.where(kept, candidates + noise, float("-inf")).max(dim=-1)
        tokens[tried] = ids.index_select(0, tried).gather(1, best[:, None])[:, 0]
        if width < vocab:
            failed = kept[:, -1] & (k.index_select(0, tried) > width) & (best_score < candidates[:, -1] + GUMBEL_BOUND)
            redo[tried[failed]] = True
    if width < vocab:
        again = redo.nonzero()[:, 0]
        if again.numel():
            rows = logits.index_select(0, again) / temperature.index_select(0, again)[:, None]
            seeds, offsets, ks, ps = (t.index_select(0, again) for t in (seed, offset, top_k, top_p))
            mp = None if min_p is None else min_p.index_select(0, again)
            tokens[again] = draw_full(rows, seeds, offsets, ks, ps, mp)
    return tokens
