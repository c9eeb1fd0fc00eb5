import pytest

from flame_llm.engine.block_manager import BlockManager
from flame_llm.engine.sequence import Sequence
from flame_llm.prefix import hash_block
from flame_llm.sampling_params import SamplingParams

BS = 16


def seq_of(tokens):
    return Sequence(list(tokens), SamplingParams(max_tokens=4), BS)


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """What the scheduler and runner do for a prefill: allocate, cover the rest, write, publish."""
    assert bm.can_allocate(seq) >= 0
    bm.allocate(seq)
    bm.append_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.publish(seq)


def test_hash_chain_depends_on_every_previous_block():
    a, b = list(range(16)), list(range(16, 32))
    assert hash_block(b, hash_block(a)) != hash_block(b)
    assert hash_block(b, hash_block(a)) == hash_block(b, hash_block(list(a)))
    assert hash_block(a) != hash_block(a[::-1])


def test_prefix_hit_refcounts_and_release():
    bm = BlockManager(8, BS)
    s1 = seq_of(range(40))  # 2 full blocks + 8 tokens
    run_prefill(bm, s1)
    assert len(s1.block_table) == 3 and bm.num_free_blocks == 5
    s2 = seq_of(list(range(40)) + [7, 7])
    assert bm.can_allocate(s2) == 32
    bm.allocate(s2)
    assert s2.block_table == s1.block_table[:2] and s2.num_cached_tokens == 32
    assert [bm.blocks[b].ref_count for b in s1.block_table] == [2, 2, 1]
    bm.deallocate(s1)
    assert [bm.blocks[b].ref_count for b in s2.block_table] == [1, 1]
    bm.deallocate(s2)
    assert bm.num_free_blocks == 8


def test_hash_not_published_before_kv_is_written():
    bm = BlockManager(8, BS)
    s1 = seq_of(range(40))
    bm.allocate(s1)
    bm.append_slots(s1, 40)
    s2 = seq_of(range(40))
    assert bm.match_prefix(s2) == []  # s1's blocks are allocated but not yet computed
    s1.num_computed_tokens = 16  # a chunk wrote the first block only
    bm.publish(s1)
    assert bm.match_prefix(s2) == [s1.block_table[0]]


def test_collision_guard_compares_token_ids():
    bm = BlockManager(8, BS)
    s1 = seq_of(range(20))
    run_prefill(bm, s1)
    block = bm.blocks[s1.block_table[0]]
    block.token_ids = [999] * BS  # as if another block's tokens had the same hash
    assert bm.match_prefix(seq_of(range(20))) == []


def test_full_block_aligned_prompt_never_hits_its_last_token():
    bm = BlockManager(8, BS)
    s1 = seq_of(range(32))
    run_prefill(bm, s1)
    s2 = seq_of(range(32))
    assert bm.can_allocate(s2) == 16  # the second block holds the last token: it is recomputed
    bm.allocate(s2)
    assert s2.num_computed_tokens == 16 and len(s2.block_table) == 1


def test_freed_cached_block_is_revived_then_evicted_when_reused():
    bm = BlockManager(4, BS)
    s1 = seq_of(range(20))
    run_prefill(bm, s1)
    bm.deallocate(s1)
    assert bm.num_free_blocks == 4
    s2 = seq_of(range(20))
    assert bm.can_allocate(s2) == 16
    bm.allocate(s2)  # revives the freed block that still holds the hash
    assert bm.num_free_blocks == 3
    bm.deallocate(s2)
    big = seq_of(range(100, 164))  # 4 blocks: reuses every free block, evicting the cached one
    run_prefill(bm, big)
    assert bm.num_evictions >= 1
    assert bm.match_prefix(seq_of(range(20))) == []


def test_can_allocate_refuses_when_pool_is_short():
    bm = BlockManager(2, BS)
    assert bm.can_allocate(seq_of(range(40))) == -1
    assert bm.can_allocate(seq_of(range(30))) == 0


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    run_prefill(bm, seq_of(range(40)))
    assert bm.can_allocate(seq_of(range(40))) == 0


@pytest.mark.parametrize("n_new,expected", [(1, 0), (8, 0), (9, 1), (25, 2)])
def test_append_slots_covers_new_tokens(n_new, expected):
    bm = BlockManager(8, BS)
    s = seq_of(range(24))
    run_prefill(bm, s)
    assert bm.blocks_needed(s, n_new) == expected
