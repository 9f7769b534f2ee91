"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, an LRU free queue and
prefix caching by block-hash chains.

A full block's hash is ``hash((parent_hash, tuple(its tokens)))``, so equal hashes mean an
equal whole prefix (the chain's root is the sequence's ``cache_root``: 0, or its LoRA adapter's key, since
the same tokens under another adapter have other K/V). Cached blocks are shared by reference count; when the count drops to
zero they stay in the free queue with their hash (still hittable) until the LRU evicts
them for a new allocation.
"""
from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set once the block is full and published

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Blocks with ``ref_cnt == 0``, least recently freed first. The front is evicted first;
    a prefix hit takes a block out of the middle in O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._q: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._q

    def popleft(self) -> KVCacheBlock:
        return self._q.popitem(last=False)[1]

    def append(self, block: KVCacheBlock) -> None:
        self._q[block.block_id] = block

    def appendleft(self, block: KVCacheBlock) -> None:
        self._q[block.block_id] = block
        self._q.move_to_end(block.block_id, last=False)

    def remove(self, block: KVCacheBlock) -> None:
        del self._q[block.block_id]


class BlockManager:
    """Owns ``num_blocks`` blocks of ``block_size`` token slots.

    Invariants: every block is either in the free queue (``ref_cnt == 0``) or referenced
    by at least one running sequence's block table (``ref_cnt`` = number of tables holding
    it); a prefix hit never covers a sequence's last token, whose logits must be computed;
    a sequence's blocks are freed tail first, so the LRU evicts tails before the shared
    heads other prompts are likelier to reuse.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}  # block hash -> block holding those tokens
        # prefix-cache counters, counted once per admission of a sequence
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _compute_hashes(self, seq: Sequence, upto_blocks: int) -> list[int]:
        hashes = seq.block_hashes
        bs = self.block_size
        for i in range(len(hashes), upto_blocks):
            parent = hashes[-1] if hashes else seq.cache_root
            hashes.append(hash((parent, tuple(seq.token_slice(i * bs, (i + 1) * bs)))))
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> list[KVCacheBlock]:
        """The longest run of cached blocks that prefixes ``seq``'s tokens, never covering its
        last token. No side effects on the pool (hashes are memoised on the sequence). None for a
        sequence asking for its prompt's logprobs, whose every prompt token must be computed."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for h in self._compute_hashes(seq, max_blocks)[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    # ------------------------------------------------------------------ updates
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[KVCacheBlock] | None = None
    ) -> bool:
        """Grow ``seq``'s block table to hold its computed tokens plus ``num_new_tokens``.

        ``computed_blocks`` (admission only) are prefix-cache hits placed at the head of an
        empty table; the caller then counts them as computed. Returns False, changing
        nothing, when the free queue cannot supply the blocks.
        """
        bs = self.block_size
        if computed_blocks is None:  # the common case, a decode or next chunk: often no new block
            need = -(-(seq.num_computed_tokens + num_new_tokens) // bs) - len(seq.block_table)
            if need <= 0:
                return True
            if need > len(self.free_queue):
                return False
        hits = computed_blocks or []
        num_computed = seq.num_computed_tokens + len(hits) * bs
        need = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_table) - len(hits)
        # hit blocks with no owner sit in the free queue and stop being free once taken
        reviving = sum(1 for b in hits if b.ref_cnt == 0)
        if need > len(self.free_queue) - reviving:
            return False
        if computed_blocks is not None and self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += len(hits) * bs
        table = seq.block_table
        for b in hits:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
            table.append(b.block_id)
        if hits:
            seq.num_registered_blocks = len(hits)
        for _ in range(max(need, 0)):
            b = self.free_queue.popleft()
            if b.block_hash is not None:  # evict: its tokens are about to be overwritten
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            table.append(b.block_id)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish ``seq``'s blocks that are now full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        # a block is hashed by its tokens' values: one holding a pending token waits for it
        n_full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        if n_full <= seq.num_registered_blocks:
            return
        hashes = self._compute_hashes(seq, n_full)
        for i in range(seq.num_registered_blocks, n_full):
            b = self.blocks[seq.block_table[i]]
            h = hashes[i]
            if b.block_hash is None and h not in self.cached:
                b.block_hash = h
                self.cached[h] = b
        seq.num_registered_blocks = n_full

    def reset_prefix_cache(self) -> bool:
        """Forget every published block hash, so no later prompt hits what the pool holds now (e.g.
        before writing blocks outside any sequence). Only while no sequence holds a block: False, and
        nothing forgotten, otherwise."""
        if self.num_free_blocks < self.num_blocks:
            return False
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()
        return True

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail first; blocks no one holds return to the free queue
        (hashed ones at the LRU's recent end, still hittable; unhashed ones at the front)."""
        for block_id in reversed(seq.block_table):
            b = self.blocks[block_id]
            b.ref_cnt -= 1
            if b.ref_cnt < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated ({seq!r})")
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    self.free_queue.appendleft(b)
                else:
                    self.free_queue.append(b)
        seq.block_table = []
        seq.num_registered_blocks = 0
