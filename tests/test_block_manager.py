"""BlockManager with no model: allocation, reference counts, the LRU free queue, prefix hits."""
import pytest

from pageserve.engine.block_manager import BlockManager
from pageserve.engine.sampling_params import SamplingParams
from pageserve.engine.sequence import Sequence

BS = 4


def make_seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def admit(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does on admission: take the hits, allocate the rest, compute all."""
    hits = bm.get_computed_blocks(seq)
    num_hit = len(hits) * bm.block_size
    assert bm.allocate_slots(seq, seq.num_tokens - num_hit, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return num_hit


def test_allocate_then_free_returns_every_block():
    bm = BlockManager(8, BS)
    a, b = make_seq(range(10), "a"), make_seq(range(5), "b")
    admit(bm, a)
    admit(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_free_blocks == 3
    assert set(a.block_table).isdisjoint(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert all(blk.ref_cnt == 0 for blk in bm.blocks)


def test_failed_allocation_changes_nothing():
    bm = BlockManager(3, BS)
    seq = make_seq(range(13))  # needs 4 blocks
    assert not bm.allocate_slots(seq, 13)
    assert seq.block_table == [] and bm.num_free_blocks == 3
    assert bm.allocate_slots(seq, 12)  # a chunk that fits
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 0


def test_append_allocates_a_block_only_at_a_boundary():
    bm = BlockManager(4, BS)
    seq = make_seq(range(4))
    admit(bm, seq)
    assert len(seq.block_table) == 1
    seq.output_token_ids.append(7)  # token 4 goes to a new block
    assert bm.allocate_slots(seq, 1)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens += 1
    seq.output_token_ids.append(8)
    assert bm.allocate_slots(seq, 1)
    assert len(seq.block_table) == 2


def test_prefix_hit_never_covers_last_prompt_token():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    prompt = list(range(100, 108))  # exactly two full blocks
    admit(bm, make_seq(prompt, "a"))
    again = make_seq(prompt, "b")
    hits = bm.get_computed_blocks(again)
    assert len(hits) == 1  # the second block holds the last token: its logits are needed
    assert len(hits) * BS < again.num_tokens


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = make_seq(list(range(9)), "a")
    b = make_seq(list(range(8)) + [99, 98], "b")
    admit(bm, a)
    assert admit(bm, b) == 8
    assert a.block_table[:2] == b.block_table[:2]
    assert [bm.blocks[i].ref_cnt for i in a.block_table[:2]] == [2, 2]
    bm.free(a)
    assert [bm.blocks[i].ref_cnt for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert all(blk.ref_cnt == 0 for blk in bm.blocks)
    assert bm.num_free_blocks == 16


def test_freed_cached_blocks_are_reused_by_a_later_identical_prefix():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    prefix = list(range(50, 62))  # three full blocks
    a = make_seq(prefix + [1, 2], "a")
    admit(bm, a)
    head = a.block_table[:3]
    bm.free(a)
    assert bm.num_free_blocks == 16  # free, yet still cached
    b = make_seq(prefix + [3], "b")
    assert admit(bm, b) == 12
    assert b.block_table[:3] == head
    assert bm.num_hit_tokens == 12 and bm.num_queried_tokens == 14 + 13
    bm.free(b)


def test_different_prefix_with_equal_block_misses():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    admit(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    # same second block, different first block: the chain hash must differ
    assert bm.get_computed_blocks(make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")) == []


def test_freed_blocks_evict_tails_first():
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    a = make_seq(range(12), "a")  # three full blocks, all cached
    admit(bm, a)
    head, mid, tail = a.block_table
    bm.free(a)
    b = make_seq([7] * 5, "b")
    assert bm.allocate_slots(b, 1)
    assert b.block_table == [tail]  # the tail is evicted first; the shared head survives longest
    c = make_seq(range(12), "c")
    assert [blk.block_id for blk in bm.get_computed_blocks(c)] == [head, mid]


def test_eviction_forgets_the_hash():
    bm = BlockManager(2, BS, enable_prefix_caching=True)
    a = make_seq(range(5), "a")
    admit(bm, a)
    bm.free(a)
    big = make_seq([9] * 8, "big")
    assert bm.allocate_slots(big, 8)  # takes both blocks, evicting a's cached head
    assert bm.get_computed_blocks(make_seq(range(5), "c")) == []
    assert len(bm.cached) == 0


def test_hit_blocks_in_the_free_queue_count_against_allocation():
    bm = BlockManager(3, BS, enable_prefix_caching=True)
    a = make_seq(range(9), "a")
    admit(bm, a)  # 3 blocks, the first two cached
    bm.free(a)
    b = make_seq(list(range(8)) + [1, 2, 3, 4, 5], "b")  # 2 hit blocks + needs 2 more: only 1 left
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    assert not bm.allocate_slots(b, 5, hits)
    assert bm.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in bm.blocks)


def test_reference_count_never_goes_negative():
    bm = BlockManager(4, BS)
    seq = make_seq(range(6))
    admit(bm, seq)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table  # a buggy caller freeing twice
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(seq)


def test_reset_prefix_cache_forgets_every_hash_but_only_when_no_sequence_holds_a_block():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = make_seq(range(12), "a")
    admit(bm, a)
    assert not bm.reset_prefix_cache()  # a holds its blocks: nothing forgotten
    assert len(bm.get_computed_blocks(make_seq(range(12), "b"))) == 2
    bm.free(a)
    assert len(bm.get_computed_blocks(make_seq(range(12), "b"))) == 2  # freed blocks stay hittable
    assert bm.reset_prefix_cache()
    assert bm.get_computed_blocks(make_seq(range(12), "c")) == [] and not bm.cached
    assert all(b.block_hash is None for b in bm.blocks) and bm.num_free_blocks == 8
