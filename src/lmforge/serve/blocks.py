"""The paged KV cache's bookkeeping: a refcounted block allocator with a prefix cache.

Blocks are indices into the KV tensors (``PagedKVCache``); this module never touches tensors.

- Every block has a reference count: the number of sequences whose block table lists it.
  :meth:`BlockAllocator.allocate` hands out a block with count 1; :meth:`~BlockAllocator.free`
  drops one reference. Freeing a block nobody holds is an error (no double free).
- Prefix caching: once a block is full its content is identified by the key
  ``(parent block's hash, its block_size token ids)`` (:func:`block_keys`) — the chain makes the
  key name the whole prefix, not just the block, and since the key holds the tokens, a hit
  compares them (dict lookup: hash, then equality), never the hash alone.
  :meth:`~BlockAllocator.register` records full blocks under that key; a later sequence
  whose prompt starts with the same tokens takes the same blocks
  (:meth:`~BlockAllocator.lookup`, count + 1) instead of recomputing them.
- A block whose count drops to zero keeps its content while it is registered: it waits in an LRU
  list and is reused on a hit, or evicted (least recently freed first) when a fresh block is
  needed and the free list is empty. Unregistered blocks go straight back to the free list.
- Sharing is read-only: only full, registered blocks are shared, and a sequence writes only into
  its own last, unregistered block. :meth:`~BlockAllocator.check_writable` enforces it.

Exercised by ``pytest tests/test_serve_blocks.py`` (hypothesis: no leak, no double free, no
block shared after a write).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

__all__ = ["BlockAllocator", "NoFreeBlocks", "block_hashes", "block_keys"]

BlockKey = tuple[int | None, tuple[int, ...]]


class NoFreeBlocks(RuntimeError):
    """Raised by :meth:`BlockAllocator.allocate` when every block is held."""


def block_keys(tokens: Sequence[int], block_size: int, parent: int | None = None) -> list[BlockKey]:
    """Prefix-cache keys of the full blocks of ``tokens`` (a trailing partial block has none):
    ``(hash of the previous key, or parent, for the first; the block's token ids)``."""
    out: list[BlockKey] = []
    h = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = (h, tuple(tokens[start : start + block_size]))
        out.append(key)
        h = hash(key)
    return out


def block_hashes(tokens: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``tokens``: ``hash`` of each :func:`block_keys` key."""
    return [hash(k) for k in block_keys(tokens, block_size, parent)]


class BlockAllocator:
    """``num_blocks`` KV blocks: reference counts, a free list and an LRU prefix cache."""

    def __init__(self, num_blocks: int, *, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_cache = enable_prefix_cache
        self.refcount = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._lru: OrderedDict[int, None] = OrderedDict()  # registered blocks nobody holds
        self._by_hash: dict[Hashable, int] = {}
        self._hash_of: dict[int, Hashable] = {}
        self.hits = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take (free list + evictable cached blocks)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free

    def allocate(self) -> int:
        """A fresh, unregistered block with reference count 1."""
        if self._free:
            block = self._free.pop()
        elif self._lru:
            block, _ = self._lru.popitem(last=False)  # evict the least recently freed
            del self._by_hash[self._hash_of.pop(block)]
        else:
            raise NoFreeBlocks(f"all {self.num_blocks} KV blocks are in use")
        self.refcount[block] = 1
        return block

    def free(self, block: int) -> None:
        """Drop one reference to ``block``."""
        if self.refcount[block] <= 0:
            raise ValueError(f"double free of KV block {block}")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self._hash_of:
                self._lru[block] = None
            else:
                self._free.append(block)

    def free_all(self, blocks: Sequence[int]) -> None:
        """Free every block of a block table (last first, so its tail is evicted first)."""
        for block in reversed(blocks):
            self.free(block)

    def lookup(self, block_hash: Hashable) -> int | None:
        """The cached block holding ``block_hash``'s content, with one more reference; or None."""
        if not self.enable_prefix_cache:
            return None
        block = self._by_hash.get(block_hash)
        if block is None:
            return None
        self.hits += 1
        if self.refcount[block] == 0:
            del self._lru[block]
        self.refcount[block] += 1
        return block

    def register(self, block: int, block_hash: Hashable) -> None:
        """Record that the held, full ``block`` holds ``block_hash``'s content (first wins)."""
        if not self.enable_prefix_cache or self.refcount[block] <= 0:
            return
        if block_hash in self._by_hash or block in self._hash_of:
            return  # same content already cached elsewhere: this copy stays private
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash

    def is_registered(self, block: int) -> bool:
        """Whether ``block`` is in the prefix cache (and so read-only)."""
        return block in self._hash_of

    def check_writable(self, block: int) -> None:
        """Raise unless ``block`` is held by exactly one sequence and not in the prefix cache."""
        if self.refcount[block] != 1 or block in self._hash_of:
            raise RuntimeError(
                f"KV block {block} is shared (refcount {self.refcount[block]}, "
                f"cached {block in self._hash_of}) and must not be written"
            )

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (after a weight update the cached KV is stale)."""
        for block in list(self._lru):
            self._free.append(block)
        self._lru.clear()
        self._by_hash.clear()
        self._hash_of.clear()
