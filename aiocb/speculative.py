"""Speculative decoding: tokens proposed ahead of the model, verified in the normal step.

A decoding request that speculates brings, besides its last token, ``k`` proposed tokens
as extra query tokens of the same forward pass; the step samples every one of those
``k + 1`` positions. Each position is drawn as it would be without speculation: greedy
rows take the argmax, sampled rows the Gumbel-max pick of their own ``(seed, token
index)`` noise. The request keeps the drawn tokens while they equal the proposal, plus
the first one that does not (or one more when all agree). Because the draw at each
position is the one a non-speculative run makes after the same prefix, the output is
token for token what it would have been without speculation, sampled rows included: the
proposal only decides how many tokens one step yields.

``method="ngram"`` (prompt lookup) proposes what followed the latest earlier occurrence
of the request's last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``)
in its prompt and output: free on the host, and right exactly where outputs copy from
their context (code edits, extraction, quoting).

A request speculates only when it can gain: not while its acceptance stays low (it backs
off for a while; a draft model's new request starts from the draft's recent acceptance
over other requests, and waits while that does not pay), not when many requests run
at once (``disable_by_batch_size``: the step is then no longer memory-bound, so extra
query tokens cost real compute), and where decode steps replay CUDA graphs, only while
its acceptance pays for what a step that verifies proposals costs against a decode step
(measured when a session starts: such a step replays a graph of its own, wider, on one
process, and runs without one under tensor parallelism).

With async batching a step is planned while the one before is still sampling, so a
request's last token is not known when its next step is planned, and a proposal needs
it. A request that speculates is therefore planned only once its token has landed: one
step of the pipeline waits for it, and the step it then runs may yield several tokens.
While it backs off (its proposals failed) it is pipelined as usual.

``method="draft"`` proposes with a smaller causal LM of the same vocabulary. The draft
model keeps its own paged cache, mirroring the target's blocks (the same block ids and
page size, the draft's own layers and heads), so the scheduler's allocations, prefix
sharing, copies and swaps serve both. In a step it runs in, the draft first runs over the
step's own inputs (keeping its cache in step with the target's), then proposes each
speculating row's tokens one decode pass at a time; the target then verifies them in the
same step. The draft draws with the request's own noise at the same token indices as
the target, so where the two distributions agree the proposals agree too, sampled rows
included. While speculation is off for a large batch the draft model does not run at
all, nor in a step where no request speculates (all of them back off) and no prompt is
computed: it sleeps, its cache misses those steps' tokens, and a request whose tokens it
missed has them computed by the draft first (a catch-up pass, in the step it proposes
again, before its proposals).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiocb.errors import InvalidConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

METHODS = ("ngram", "draft")
#: ``num_speculative_tokens`` of each method when not given
DEFAULT_TOKENS = {"ngram": 8, "draft": 4}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How requests speculate (``aiocb.Manager(model, speculative_config=...)``)."""

    #: ``"ngram"``: prompt lookup over the request's prompt and output; ``"draft"``: a
    #: smaller model's proposals
    method: str = "ngram"
    #: ``method="draft"``: the draft model, a ``PreTrainedModel`` or a path or hub id that
    #: ``AutoModelForCausalLM.from_pretrained`` loads (in the target's dtype, on its device)
    draft_model: PreTrainedModel | str | None = None
    #: tokens proposed per step at most (``k``); None: 8 for ``"ngram"`` (a longer proposal
    #: costs only its verification), 4 for ``"draft"`` (each proposed token is also a pass
    #: of the draft model)
    num_speculative_tokens: int | None = None
    #: the shortest and longest suffix of the request that is looked up (at most
    #: :data:`MOST_LOOKUP_LENGTH`: each length is indexed at every position of a request)
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    #: no speculation while more than this many requests run, decoding or computing their
    #: prompts (None: whatever the batch)
    disable_by_batch_size: int | None = 32
    #: a request whose recent acceptance falls below this share stops proposing for
    #: ``backoff_steps`` steps, then tries again (``method="draft"``: below this or the
    #: draft's share of the target's weight bytes (at most 0.9), whichever is larger, which
    #: is what a proposed token costs against the token it may save where decoding is
    #: memory-bound; and a pause after a failed try is twice the one before, up to 8 x
    #: ``backoff_steps``). Where decode steps replay CUDA graphs, the floor is at least
    #: what makes a step that verifies proposals worth its measured cost against a decode
    #: step (:class:`Acceptance`)
    min_acceptance: float = 0.2
    backoff_steps: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidConfigError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_TOKENS[self.method])
        if self.method == "draft":
            if self.draft_model is None:
                raise InvalidConfigError('speculative method "draft" needs a draft_model (a model or a path)')
            looked_up = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name.startswith("prompt")}
            changed = [name for name, value in looked_up.items() if value != _DEFAULTS[name]]
            if changed:
                raise InvalidConfigError(f'{", ".join(changed)} apply to method "ngram" only, not "draft"')
        elif self.draft_model is not None:
            raise InvalidConfigError(f'draft_model applies to method "draft" only, not {self.method!r}')
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "backoff_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidConfigError(f"{name} must be an int >= 1, got {value!r}")
        if (self.num_speculative_tokens or 0) > MOST_SPECULATIVE_TOKENS:
            raise InvalidConfigError(
                f"num_speculative_tokens must be <= {MOST_SPECULATIVE_TOKENS} (each step verifies that many a row, "
                f"and its host work grows with them), got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidConfigError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.prompt_lookup_max > MOST_LOOKUP_LENGTH:
            raise InvalidConfigError(
                f"prompt_lookup_max must be <= {MOST_LOOKUP_LENGTH} (every length up to it is indexed at each "
                f"position of every request, in host memory and time), got {self.prompt_lookup_max}"
            )
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise InvalidConfigError(f"disable_by_batch_size must be an int >= 1 or None, got {size!r}")
        acceptance = self.min_acceptance
        if isinstance(acceptance, bool) or not isinstance(acceptance, (int, float)) or not 0.0 <= acceptance <= 1.0:
            raise InvalidConfigError(f"min_acceptance must be in [0, 1], got {self.min_acceptance!r}")

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> SpeculativeConfig:
        """A config from a mapping (``--speculative-config`` JSON); unknown keys are refused."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise InvalidConfigError(f"unknown speculative config field(s) {unknown}; known: {sorted(known)}")
        return cls(**fields)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
#: the longest suffix prompt lookup may look up: every decoded token is indexed at each
#: length (lengths 2 to 16 took 2 ms of the loop a step for 32 requests accepting 8
#: proposals each, 2 to 4 0.3 ms), and an index of a 32,768-token request holds an n-gram
#: per position and length (about 150 bytes each); vLLM's and transformers' defaults are 5
#: and less
MOST_LOOKUP_LENGTH = 8
#: the most tokens a request may propose a step (vLLM's and transformers' defaults are 5 to
#: 10; a proposal is verified in one pass, and a wider one is rarely accepted whole)
MOST_SPECULATIVE_TOKENS = 64


def load_draft_model(config: SpeculativeConfig | None, target: PreTrainedModel) -> PreTrainedModel | None:
    """The draft model ``config`` names (loaded from its path in the target's dtype, on its
    device), checked against ``target``; None unless the method is ``"draft"``."""
    if config is None or config.method != "draft":
        return None
    from transformers import AutoModelForCausalLM, PreTrainedModel

    draft = config.draft_model
    if isinstance(draft, str):
        param = next(target.parameters())
        try:
            loaded = AutoModelForCausalLM.from_pretrained(draft, dtype=param.dtype)
            draft = loaded.to(param.device).eval()  # type: ignore[arg-type]  # (a device, not a dtype)
        except (OSError, ValueError) as exc:
            raise InvalidConfigError(f"draft_model {config.draft_model!r} could not be loaded: {exc}") from exc
    if not isinstance(draft, PreTrainedModel):
        kind = type(draft).__name__
        raise InvalidConfigError(f"draft_model must be a transformers PreTrainedModel or a path, got {kind}")
    if draft is target:
        raise InvalidConfigError("draft_model must be a model of its own, not the target model itself")
    target_param, draft_param = next(target.parameters()), next(draft.parameters())
    if draft_param.device != target_param.device:
        raise InvalidConfigError(
            f"draft_model is on {draft_param.device}, the target model on {target_param.device}: "
            "they must share a device"
        )
    draft_vocab = int(draft.config.get_text_config().vocab_size)
    target_vocab = int(target.config.get_text_config().vocab_size)
    # (vocabularies padded to different sizes are the same tokenizer's; far apart they are not)
    if abs(draft_vocab - target_vocab) > max(256, target_vocab // 100):
        raise InvalidConfigError(
            f"draft_model's vocabulary ({draft_vocab}) is not the target's ({target_vocab}): "
            "a draft model needs the target's tokenizer"
        )
    return draft


def draft_share(draft: PreTrainedModel, target: PreTrainedModel) -> float:
    """The draft's share of the target's weight bytes: what a draft pass costs against the
    target's step where decoding is memory-bound (both read their weights once a pass).
    Buffers count too (quantized weights are often buffers, or packed into fewer elements)."""
    return _weight_bytes(draft) / max(1, _weight_bytes(target))


def _weight_bytes(model: PreTrainedModel) -> int:
    tensors = itertools.chain(model.parameters(), model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


#: The highest back-off floor a draft's share of the target sets: a draft as dear as the
#: target (or one whose share is overstated) still speculates while nearly all is accepted.
_MOST_SHARE_FLOOR = 0.9
#: How quickly a request's acceptance estimate follows its latest steps.
_DECAY = 0.7
#: A draft model's request's longest pause, in ``backoff_steps``: its pauses double while
#: the tries after them fail.
_LONGEST_DRAFT_PAUSE = 8


class Acceptance:
    """One request's recent acceptance, which sets how many tokens it proposes and when
    it backs off.

    The width follows transformers' assisted generation (its "heuristic" schedule): it
    starts at ``num_speculative_tokens``, a proposal taken whole earns two more tokens
    (up to that bound), any other costs one. Acceptance comes in runs (a copy goes on, or
    it has ended), so the last step says more about the next than an average of recent
    ones; a width set by the recent share of tokens accepted cut copies short
    (``bench/RESULTS.md``, 2026-12-04). The share sets only when a request backs off: for
    ``backoff_steps`` steps; where a try costs a draft model's passes, twice as long each
    time the try after a pause fails too (up to ``longest_pause`` times, back to one once a
    try does not fail), so that a request whose proposals never pay soon stops paying for
    them. A try of prompt lookup costs only its verification, and matches come now and
    then: its pauses stay short.

    Where decode steps replay CUDA graphs, a step that verifies proposals (several query
    tokens a row) costs ``verify_cost`` decode steps (measured at start on one process,
    where it replays a graph of its own and costs about one decode step while decoding is
    memory-bound; under tensor parallelism it runs eagerly, unmeasured, with the floor
    given; on the H200, before those graphs, eager verification of the bundled model was
    launch-bound, and prompt lookup at 0.6 acceptance ran at 0.42x no speculation).
    Proposing ``w`` tokens then pays only if the ``1 + acceptance * w`` tokens of such a
    step are worth its cost, ``verify_cost`` decode steps, plus a draft model's ``w``
    passes at ``pass_share`` of the target's each: the floor rises to
    ``(verify_cost * (1 + w * pass_share) - 1) / w`` (above 1: it never pays, and each try
    is followed by a pause), times the step's rows per speculating row (the rows that do
    not speculate pay for the dearer step too), and where that raises the floor of a
    one-token proposal, every try's pause doubles after a failed one, since a try is no
    longer cheap. The costs are the smallest batch's, whose dearer step costs the most
    against its decode replay: a batch's own is lower. Without graphs (``verify_cost`` 1)
    the floor is the one given.
    """

    __slots__ = (
        "_config",
        "_cooldown",
        "_cost",
        "_floor",
        "_k",
        "_longest",
        "_pass_share",
        "_pause",
        "_retrying",
        "_width",
        "acceptance",
    )

    def __init__(
        self,
        config: SpeculativeConfig,
        floor: float | None = None,
        longest_pause: int = 1,
        verify_cost: float = 1.0,
        pass_share: float = 0.0,
    ) -> None:
        self._config = config
        #: the acceptance under which it backs off (``min_acceptance`` unless given), where
        #: a step that verifies proposals costs what a decode step does
        self._floor = config.min_acceptance if floor is None else floor
        self._cost = verify_cost
        self._pass_share = pass_share
        # A try is cheap unless its cost raises the floor of a one-token proposal: a step
        # that verifies proposals costing a few percent more than a decode step (their
        # graphs' replays) leaves prompt lookup's pauses short.
        cheap = self.floor(1) <= self._floor
        self._longest = longest_pause if cheap else max(longest_pause, _LONGEST_DRAFT_PAUSE)
        #: the recent share of proposed tokens accepted (starts hopeful)
        self.acceptance = 1.0
        self._cooldown = 0
        #: whether the next proposal is the try after a pause (which alone decides)
        self._retrying = False
        #: the next pause, in ``backoff_steps``
        self._pause = 1
        assert config.num_speculative_tokens is not None  # (set by the config's __post_init__)
        self._k = self._width = config.num_speculative_tokens

    @property
    def paused(self) -> bool:
        """Whether the request backs off (its next :meth:`ready` is False)."""
        return self._cooldown > 0

    def ready(self) -> bool:
        """Whether the request tries to speculate this step (False while it backs off; each
        call is one step of the pause)."""
        if self._cooldown:
            self._cooldown -= 1
            return False
        return True

    def width(self, k: int) -> int:
        """How many of at most ``k`` tokens to propose, one at least."""
        return max(1, min(k, self._width))

    def floor(self, width: int, load: float = 1.0) -> float:
        """The recent acceptance under which a request proposing ``width`` tokens backs off,
        where its step's cost without a graph falls on it ``load`` times: the step's rows
        over its speculating rows, when the step would have replayed a graph without the
        proposals (0 when it would not: it runs without one anyway)."""
        if self._cost <= 1.0 or load <= 0.0:
            return self._floor
        return max(self._floor, load * (self._cost * (1 + width * self._pass_share) - 1) / width)

    def record(self, proposed: int, accepted: int, load: float = 1.0) -> None:
        """How a step's proposal fared (``load`` as in :meth:`floor`); a request that keeps
        failing backs off."""
        if accepted == proposed:
            self._width = min(self._k, self._width + 2)
        else:
            self._width = max(1, self._width - 1)
        floor = self.floor(proposed, load)
        if self._retrying:
            # The try after a pause alone decides whether it pauses again: as if its recent
            # acceptance had been the floor it is judged by.
            self._retrying = False
            self.acceptance = min(floor, 1.0)
        self.acceptance = _DECAY * self.acceptance + (1 - _DECAY) * accepted / proposed
        if self.acceptance < floor:
            self._cooldown = self._config.backoff_steps * self._pause
            self._pause = min(2 * self._pause, self._longest)
            self._retrying = True
        else:
            self._pause = 1


class DraftProposer(Acceptance):
    """One request's share of a draft model's proposals: how many tokens it asks for (the
    draft model proposes them on the device, in the step that verifies them), and how far
    the draft's cache holds its tokens.

    It starts from ``prior``, the draft's recent acceptance over other requests' tries, when
    there is one: a draft is about as good for one request as for the next on like work.
    Under the floor, the request waits: it proposes nothing, and the draft computes none of
    its tokens, until that acceptance recovers (it then catches up and tries), which the
    requests that scout find out (the scheduler starts one in :data:`SCOUT_EVERY` of those
    that would wait hopeful instead). Before any figure exists the scheduler has one
    request try and the others wait for its figure; that first try alone decides whether
    it backs off, as a try after a pause does. A try after a pause
    would cost the draft's pass over every token the request has (its prompt, at first):
    a draft that does not pay on a workload then costs a scout's share of that.
    """

    __slots__ = ("drafted", "marked", "waiting")

    def __init__(
        self,
        config: SpeculativeConfig,
        drafted: int,
        share: float = 0.0,
        verify_cost: float = 1.0,
        prior: float | None = None,
    ) -> None:
        floor = max(config.min_acceptance, min(share, _MOST_SHARE_FLOOR))
        super().__init__(config, floor, _LONGEST_DRAFT_PAUSE, verify_cost, share)
        #: whether it waits for the draft's acceptance over other requests to recover
        self.waiting = prior is not None and not self.hopes(prior)
        if prior is not None:
            self.acceptance = prior
        else:
            # Nothing known of the draft: its first try alone decides, as one after a pause
            # does (a failed try is dear: hopeful, it would take three to back off).
            self._retrying = True
        #: how many of the request's first tokens the draft's cache holds: steps the draft
        #: sleeps through leave a gap past it, which the draft catches up on (in the step
        #: the request proposes again, before its proposals)
        self.drafted = drafted
        #: how many of the request's first blocks are recorded as the draft's for prefix
        #: hits (:meth:`aiocb.core.kv_cache.KVCacheManager.mark_drafted`)
        self.marked = 0

    @property
    def paused(self) -> bool:
        """Whether the request backs off or waits."""
        return self.waiting or super().paused

    def hopes(self, prior: float | None) -> bool:
        """Whether the draft's acceptance over other requests (``prior``) would let a
        request that waits try."""
        return prior is not None and prior >= self.floor(self._width)

    def propose(self, k: int, prior: float | None = None) -> int:
        """How many tokens to propose this step, of at most ``k`` (0: none); ``prior`` is
        the draft's acceptance over other requests now."""
        if self.waiting:
            if prior is None or not self.hopes(prior):
                return 0
            self.waiting = False
            self.acceptance = prior
        return self.width(k) if self.ready() else 0


#: One request in this many of those that would start waiting for a draft's acceptance to
#: recover starts hopeful instead: its tries keep that acceptance current.
SCOUT_EVERY = 8


class NgramProposer(Acceptance):
    """One request's prompt lookup: an index of its n-grams, kept up to date as tokens come.

    For each ``n`` the index maps an n-gram to the position just after its latest
    occurrence; adding a token looks the new suffix up before recording it, so a
    proposal always comes from an *earlier* occurrence. Indexing a token costs about
    0.12 microseconds per token of its n-grams (``n`` for each length ``n`` looked up: the
    n-gram is made and hashed); the caller bounds how many such tokens a step indexes in
    all (:meth:`propose`'s ``budget``), so a long prompt is caught up over several steps
    and proposes nothing until then.
    """

    __slots__ = ("_index", "_index_cost", "_indexed", "_next")

    def __init__(self, config: SpeculativeConfig, verify_cost: float = 1.0) -> None:
        super().__init__(config, verify_cost=verify_cost)
        self._indexed = 0
        self._index: list[dict[tuple[int, ...], int]] = [
            {} for _ in range(config.prompt_lookup_min, config.prompt_lookup_max + 1)
        ]
        #: per n, where the continuation of the current suffix starts (-1: not seen before)
        self._next = [-1] * len(self._index)
        #: what indexing a token costs: the tokens of its n-grams
        self._index_cost = sum(range(config.prompt_lookup_min, config.prompt_lookup_max + 1))

    def propose(self, tokens: list[int], k: int, budget: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that may follow ``tokens`` (empty: nothing to propose), indexing
        first the tokens its last step gave (``num_speculative_tokens + 1`` at most: each
        decoded token is indexed, whatever the budget), or, further behind (a prompt to catch
        up), n-grams of at most ``budget`` tokens in all (a token's at least, while any is
        left); and how many of the budget's that took (charged, a step's own tokens left the
        requests planned after the first few behind for good with long lengths)."""
        steady = min(k, self._config.num_speculative_tokens or 0) + 1  # (a step's tokens at most)
        if len(tokens) - self._indexed <= steady:
            self._catch_up(tokens, steady)
            indexed = 0
        else:
            indexed = self._catch_up(tokens, -(-budget // self._index_cost)) * self._index_cost
        if self._indexed < len(tokens):
            return [], indexed  # (still catching up: not a failed proposal)
        if not self.ready():
            return [], indexed
        for i in range(len(self._index) - 1, -1, -1):  # the longest match first
            start = self._next[i]
            if start >= 0:
                return tokens[start : start + self.width(k)], indexed
        # Finding nothing is no failed proposal: it cost no compute. (Counted as one, it
        # paused requests whose matches come now and then, code they partly copy, for most
        # of their run: bench/RESULTS.md, 2026-12-04.)
        return [], indexed

    def _catch_up(self, tokens: list[int], budget: int) -> int:
        low = self._config.prompt_lookup_min
        start = self._indexed
        end = min(len(tokens), start + max(budget, 0))
        for position in range(self._indexed, end):
            for i, index in enumerate(self._index):
                n = low + i
                if position + 1 < n:
                    self._next[i] = -1
                    continue
                gram = tuple(tokens[position + 1 - n : position + 1])
                self._next[i] = index.get(gram, -1)
                index[gram] = position + 1
        self._indexed = end
        return end - start
