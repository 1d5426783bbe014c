"""Per-request block tables over one block pool per cache group.

A cache group is a set of layers that share a block table. Full-attention layers form
one group whose table grows with the sequence; layers with a sliding window form a group
whose table is a small ring: position ``p`` lives in ring block ``(p // page_size) % R``,
with ``R`` just large enough for the last ``window - 1`` positions, which is all a later
query can see. Hybrid models have both.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiocb.core.block_pool import LONG_ROPE_ROOT_HASH, ROOT_HASH, BlockPool, hash_block
from aiocb.core.request import NONE_YET, Request


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """The layers of one cache group and the number of blocks its pool holds."""

    layer_ids: tuple[int, ...]
    num_blocks: int
    sliding_window: int | None = None
    #: blocks of host memory for the KV of preempted requests (CPU offloading)
    num_host_blocks: int = 0


def ring_size(sliding_window: int, page_size: int) -> int:
    """Blocks a sliding-window request needs at most: the last ``window - 1`` positions
    can straddle one block more than they fill."""
    return -(-(sliding_window - 1) // page_size) + 1


def kept_positions(sliding_window: int) -> int:
    """How many of a row's last positions a sliding-window group writes in a step: the
    ``window - 1`` a later query may see (at least its last, which its own query reads)."""
    return max(sliding_window - 1, 1)


def ring_safe_tokens(sliding_window: int, page_size: int) -> int:
    """The most new tokens a row of a sliding-window group may bring in one step for its
    queries to find every key they need in the ring once the step has written: each new
    token overwrites the key ``ring_size * page_size`` positions before it, which the row's
    first query must not need, and a row writes only its last :func:`kept_positions`."""
    ring = ring_size(sliding_window, page_size) * page_size
    return min(kept_positions(sliding_window), ring - sliding_window + 1)


class KVCacheManager:
    """Allocates, shares and frees the KV blocks of every request."""

    def __init__(self, groups: list[CacheGroup], page_size: int, *, enable_prefix_caching: bool) -> None:
        if not groups:
            raise ValueError("a KV cache needs at least one cache group")
        self.groups = groups
        self.page_size = page_size
        self.pools = [BlockPool(group.num_blocks) for group in groups]
        self._ring = [ring_size(g.sliding_window, page_size) if g.sliding_window is not None else None for g in groups]
        # A sliding layer forgets old positions, so a block's content depends on more than
        # its prefix: sharing is only sound when every layer keeps every position. Hits are
        # looked up and registered in the first pool only, so that must be the only pool.
        self.prefix_caching = enable_prefix_caching and len(groups) == 1 and groups[0].sliding_window is None
        #: prompt tokens admitted requests found in the prefix cache (counted by the scheduler)
        self.num_prefix_hit_tokens = 0
        #: one cache group, of full attention: a request's blocks are one list, one block per
        #: ``page_size`` tokens (the scheduler checks a decode step's room itself then)
        self.single_full = len(groups) == 1 and groups[0].sliding_window is None
        self.host_pools = [BlockPool(g.num_host_blocks) if g.num_host_blocks else None for g in groups]
        self.offloading = all(pool is not None for pool in self.host_pools)
        self.num_offloaded_blocks = 0
        self.num_restored_blocks = 0
        #: registered blocks whose every position a draft model's cache holds too (the draft
        #: writes its cache in the target's blocks, but sleeps through some steps): a prefix
        #: hit serves the draft only the leading blocks among these (see :meth:`drafted_blocks`)
        self.draft_blocks: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, summed over the groups."""
        return sum(pool.num_free for pool in self.pools)

    @property
    def num_total_blocks(self) -> int:
        """All blocks, summed over the groups."""
        return sum(pool.num_blocks for pool in self.pools)

    @property
    def free_fraction(self) -> float:
        """The free share of the tightest group."""
        return min(pool.num_free / pool.num_blocks for pool in self.pools)

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the cache can hold when it holds nothing else."""
        # A full group holds one block per page of the sequence; a sliding group a whole
        # ring, so any length fits unless its pool is smaller than one ring.
        limits = [
            pool.num_blocks * self.page_size
            for pool, ring in zip(self.pools, self._ring, strict=True)
            if ring is None or pool.num_blocks < ring
        ]
        return min(limits, default=2**62)

    def fits_alone(self, num_tokens: int) -> bool:
        """Whether one request of ``num_tokens`` tokens fits the whole cache."""
        return all(self._blocks_wanted(i, num_tokens) <= pool.num_blocks for i, pool in enumerate(self.pools))

    def _blocks_wanted(self, group: int, num_tokens: int) -> int:
        blocks = -(-num_tokens // self.page_size)
        ring = self._ring[group]
        return blocks if ring is None else min(blocks, ring)

    def has_room(self, request: Request, num_new_tokens: int, spare: int = 0) -> bool:
        """Whether every group has the free blocks :meth:`allocate` would give ``request``
        for ``num_new_tokens`` more tokens, and ``spare`` more in each group of full
        attention (a sliding group never gives a request more than a ring)."""
        total = request.num_computed_tokens + num_new_tokens
        held = request.block_ids or [[] for _ in self.pools]
        return all(
            self._blocks_wanted(i, total) - len(held[i]) + (spare if ring is None else 0) <= pool.num_free
            for i, (pool, ring) in enumerate(zip(self.pools, self._ring, strict=True))
        )

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Give ``request`` the blocks for ``num_new_tokens`` more tokens; all or nothing."""
        if not request.block_ids:
            request.block_ids = [[] for _ in self.pools]
        total = request.num_computed_tokens + num_new_tokens
        if self.single_full and total <= len(request.block_ids[0]) * self.page_size:
            return True  # the common decode step: the last block has room
        needed = [self._blocks_wanted(i, total) - len(request.block_ids[i]) for i in range(len(self.pools))]
        if any(n > pool.num_free for n, pool in zip(needed, self.pools, strict=True)):
            return False
        for i, (n, pool) in enumerate(zip(needed, self.pools, strict=True)):
            if n > 0:
                new_blocks = pool.allocate(n)
                assert new_blocks is not None  # checked above
                request.block_ids[i].extend(new_blocks)
        return True

    def trim(self, request: Request) -> None:
        """Give back the blocks past those that ``request``'s computed tokens and its next
        one need (the positions of proposed tokens that were rejected)."""
        total = request.num_computed_tokens + 1
        for g, (pool, blocks) in enumerate(zip(self.pools, request.block_ids, strict=False)):
            keep = self._blocks_wanted(g, total)
            if len(blocks) <= keep:
                continue
            pool.free(blocks[keep:])
            del blocks[keep:]
            if request.block_cuts is None:
                request.block_cuts = [len(b) for b in request.block_ids]
            request.block_cuts[g] = min(request.block_cuts[g], keep)

    def fork(self, parent: Request, child: Request) -> list[list[tuple[int, int]]] | None:
        """Give ``child`` the KV of the parent's ``num_computed_tokens`` tokens: the full blocks
        of full-attention groups are shared (one more reference: they are never written
        again), the rest (the partial last block; every block of a sliding ring, which
        wraps around) are copied. Returns, per group, the ``(parent block, child block)``
        copies to make before the child's next step, or None (nothing done) when a pool has
        no room for the copies."""
        full = parent.num_computed_tokens // self.page_size
        plan: list[tuple[list[int], list[int]]] = []
        for g, blocks in enumerate(parent.block_ids):
            shared = blocks[:full] if self._ring[g] is None else []
            plan.append((shared, blocks[len(shared) :]))
        if any(len(copied) > pool.num_free for (_, copied), pool in zip(plan, self.pools, strict=True)):
            return None
        child.block_ids = []
        copies: list[list[tuple[int, int]]] = []
        for (shared, copied), pool in zip(plan, self.pools, strict=True):
            for block in shared:
                pool.acquire(block)
            fresh = pool.allocate(len(copied)) if copied else []
            assert fresh is not None  # checked above
            child.block_ids.append(shared + fresh)
            copies.append(list(zip(copied, fresh, strict=True)))
        if self.prefix_caching:
            child.block_hashes = list(parent.block_hashes[:full])
            child.num_registered_blocks = min(parent.num_registered_blocks, full)
        child.num_computed_tokens = parent.num_computed_tokens
        return copies

    def free(self, request: Request) -> None:
        """Return every block of ``request``; hashed full blocks stay findable."""
        for pool, blocks in zip(self.pools, request.block_ids, strict=False):
            pool.free(blocks)
        request.block_ids = NONE_YET
        request.num_registered_blocks = 0

    def offload(self, request: Request) -> list[list[tuple[int, int]]] | None:
        """Move a request's blocks to host memory: returns, per group, the
        ``(device block, host block)`` copies to make before the device blocks are reused,
        and frees the device blocks. None (and nothing done) if the host pool is too full.
        """
        if not self.offloading or not request.block_ids:
            return None
        host_pools = [p for p in self.host_pools if p is not None]
        if any(len(blocks) > pool.num_free for blocks, pool in zip(request.block_ids, host_pools, strict=True)):
            return None
        copies: list[list[tuple[int, int]]] = []
        host_ids: list[list[int]] = []
        for blocks, pool in zip(request.block_ids, host_pools, strict=True):
            taken = pool.allocate(len(blocks)) or []
            copies.append(list(zip(blocks, taken, strict=True)))
            host_ids.append(taken)
            self.num_offloaded_blocks += len(blocks)
        self.free(request)
        request.host_block_ids = host_ids
        return copies

    def restore(self, request: Request) -> list[list[tuple[int, int]]]:
        """After :meth:`allocate` gave an offloaded request device blocks again: per
        group, the ``(host block, device block)`` copies that bring its KV back; the host
        blocks are free once those copies are made (they are ordered before any later
        offload's copies)."""
        copies: list[list[tuple[int, int]]] = []
        for g, host_blocks in enumerate(request.host_block_ids):
            pool = self.host_pools[g]
            assert pool is not None
            copies.append(list(zip(host_blocks, request.block_ids[g], strict=False)))
            pool.free(host_blocks)
            self.num_restored_blocks += len(host_blocks)
        request.host_block_ids = NONE_YET
        return copies

    def drop_host_copy(self, request: Request) -> None:
        """Free the host blocks of an offloaded request that ended before it resumed."""
        for pool, blocks in zip(self.host_pools, request.host_block_ids, strict=False):
            if pool is not None:
                pool.free(blocks)
        request.host_block_ids = NONE_YET

    def match_prefix(self, request: Request) -> int:
        """Attach cached blocks holding a prefix of ``request``; returns the tokens covered.

        The last token is never served from the cache: its logits are needed to sample.
        """
        if not self.prefix_caching or request.block_ids:
            return 0
        page = self.page_size
        max_blocks = (request.num_tokens - 1) // page
        if max_blocks and not request.block_hashes:
            request.block_hashes = []
        pool, hashes = self.pools[0], request.block_hashes
        hits: list[int] = []
        parent = self._root(request)
        for i in range(max_blocks):
            tokens = request.token_ids[i * page : (i + 1) * page]
            if i == len(hashes):  # (hashed up to the first miss: a long new prompt's blocks as they complete)
                hashes.append(hash_block(parent, tokens))
            block_hash = hashes[i]
            block = pool.lookup(block_hash, parent, tokens)
            if block is None:
                break
            hits.append(block)
            parent = block_hash
        for block in hits:
            pool.acquire(block)
        request.block_ids = [hits]
        request.num_registered_blocks = len(hits)
        return len(hits) * self.page_size

    def unmatch_last_block(self, request: Request) -> None:
        """Give back the last block :meth:`match_prefix` attached (its tokens are computed again)."""
        block = request.block_ids[0].pop()
        self.pools[0].free([block])
        request.num_registered_blocks -= 1
        request.num_computed_tokens -= self.page_size

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed blocks for prefix sharing."""
        if not self.prefix_caching or not request.block_ids:
            return
        # Only positions whose token is known: a step in flight may still be sampling one.
        known = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(known // self.page_size, len(request.block_ids[0]))
        if num_full <= request.num_registered_blocks:
            return  # (most steps: no block completed)
        self._extend_hashes(request, num_full)
        pool = self.pools[0]
        for i in range(request.num_registered_blocks, num_full):
            block = request.block_ids[0][i]
            parent = request.block_hashes[i - 1] if i else self._root(request)
            tokens = request.token_ids[i * self.page_size : (i + 1) * self.page_size]
            self.draft_blocks.discard(block)  # (new content: the draft's is unknown until marked)
            pool.register(block, request.block_hashes[i], parent, tokens)
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def mark_drafted(self, request: Request, num_tokens: int, marked: int) -> int:
        """Record that a draft model's cache holds the first ``num_tokens`` tokens of
        ``request``: its registered blocks they cover, past the first ``marked`` (recorded
        before), are :attr:`draft_blocks`. Returns how many of its blocks are recorded now."""
        covered = min(num_tokens // self.page_size, request.num_registered_blocks)
        if covered <= marked:
            return marked
        self.draft_blocks.update(request.block_ids[0][marked:covered])
        return covered

    def drafted_blocks(self, request: Request) -> int:
        """How many of ``request``'s first blocks (prefix hits) a draft model's cache holds too."""
        count = 0
        for block in request.block_ids[0][: request.num_registered_blocks] if request.block_ids else ():
            if block not in self.draft_blocks:
                break
            count += 1
        return count

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        if not request.block_hashes:
            request.block_hashes = []
        hashes = request.block_hashes
        page = self.page_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else self._root(request)
            hashes.append(hash_block(parent, request.token_ids[i * page : (i + 1) * page]))

    @staticmethod
    def _root(request: Request) -> bytes:
        """The parent hash of ``request``'s first block: a request whose every token takes
        a longrope model's long setting holds other keys than another request's of the same
        tokens (see :mod:`aiocb.runner.long_rope`)."""
        return LONG_ROPE_ROOT_HASH if request.long_rope else ROOT_HASH
