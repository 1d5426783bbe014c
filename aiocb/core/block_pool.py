"""A fixed pool of KV blocks: O(1) allocate and free, reference counts, prefix hashes.

A block whose reference count drops to zero goes back to the pool. If it holds a full,
hashed block of tokens it keeps its hash, so a later request with the same prefix can
take it back (a prefix hit) until the pool hands it out again; blocks without a hash are
handed out first, then hashed ones least recently freed first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

#: The parent hash of a request's first block ...
ROOT_HASH = b"aiocb-root"
#: ... and of a request's whose keys all take a longrope model's long frequencies
LONG_ROPE_ROOT_HASH = b"aiocb-root-long-rope"


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: its tokens and everything before them."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockPool:
    """Owns block ids ``0 .. num_blocks-1`` of one cache group."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # Free blocks without a hash: a stack, so recently used memory is reused first.
        self._free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks that keep a hash, least recently freed first.
        self._free_hashed: OrderedDict[int, None] = OrderedDict()
        self._block_hash: list[bytes | None] = [None] * num_blocks
        # What a hashed block holds, to verify a hit: (parent hash, its tokens).
        self._block_key: list[tuple[bytes, tuple[int, ...]] | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free ones that keep a hash included)."""
        return len(self._free_plain) + len(self._free_hashed)

    @property
    def num_cached(self) -> int:
        """Hashed blocks, in use or free, that a prefix lookup can find."""
        return len(self._by_hash)

    def ref_count(self, block_id: int) -> int:
        """How many requests hold ``block_id``."""
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        """The prefix hash ``block_id`` holds, if any."""
        return self._block_hash[block_id]

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks with reference count 1, or None (and nothing taken)."""
        if count > self.num_free:
            return None
        blocks: list[int] = []
        for _ in range(count):
            if self._free_plain:
                block = self._free_plain.pop()
            else:
                block, _ = self._free_hashed.popitem(last=False)
                self._forget_hash(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; blocks nobody holds return to the pool."""
        # Freed in reverse so a request's first blocks (the most shareable) stay longest.
        for block in reversed(block_ids):
            count = self._ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self._ref_counts[block] = count
            if count == 0:
                if self._block_hash[block] is None:
                    self._free_plain.append(block)
                else:
                    self._free_hashed[block] = None

    def lookup(self, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The block holding exactly these tokens after this parent, if one is cached."""
        block = self._by_hash.get(block_hash)
        if block is None:
            return None
        if self._block_key[block] != (parent_hash, tuple(token_ids)):
            return None  # a hash collision: never serve another prefix's KV
        return block

    def acquire(self, block_id: int) -> None:
        """Take one more reference to a cached block (a prefix hit)."""
        if self._ref_counts[block_id] == 0:
            del self._free_hashed[block_id]
        self._ref_counts[block_id] += 1

    def register(self, block_id: int, block_hash: bytes, parent_hash: bytes, token_ids: Sequence[int]) -> None:
        """Record that ``block_id`` now holds a full block with this hash.

        If another block already holds the same content, the first one stays the one
        lookups find; this block simply stays unhashed.
        """
        if self._block_hash[block_id] is not None or block_hash in self._by_hash:
            return
        self._block_hash[block_id] = block_hash
        self._block_key[block_id] = (parent_hash, tuple(token_ids))
        self._by_hash[block_hash] = block_id

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            del self._by_hash[block_hash]
            self._block_hash[block_id] = None
            self._block_key[block_id] = None
