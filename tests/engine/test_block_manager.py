"""Block pool / prefix cache: exact block ids, hash hits, eviction order, no leaks."""

from __future__ import annotations

import pytest

from engine.kv.block_manager import BlockPool, KVCacheManager, hash_block

BS = 4


@pytest.fixture
def mgr():
    m = KVCacheManager(num_blocks=8, block_size=BS)
    yield m
    # Every test must leave the pool full again.
    assert m.num_free_blocks == 8, "blocks leaked"
    assert all(b.ref_cnt == 0 for b in m.pool.blocks)


def test_allocate_exact_ids_and_free_order(mgr: KVCacheManager) -> None:
    assert mgr.allocate_slots("a", 0, 6)  # 2 blocks
    assert mgr.block_table("a") == [0, 1]
    assert mgr.allocate_slots("b", 0, 9)  # 3 blocks
    assert mgr.block_table("b") == [2, 3, 4]
    assert mgr.num_free_blocks == 3
    # Growing "a" by 3 tokens (6 -> 9) needs a third block: the next free one.
    assert mgr.allocate_slots("a", 6, 3)
    assert mgr.block_table("a") == [0, 1, 5]
    mgr.free("a")
    # Freed tail-first: 5, 1, 0 join the back of the free queue after 6, 7.
    assert list(mgr.pool._free) == [6, 7, 5, 1, 0]
    mgr.free("b")


def test_allocation_failure_is_a_return_value(mgr: KVCacheManager) -> None:
    assert mgr.allocate_slots("a", 0, 8 * BS)
    assert not mgr.allocate_slots("b", 0, 1)
    assert not mgr.has("b")
    assert not mgr.allocate_slots("a", 8 * BS, 1)  # no growth either
    assert mgr.block_table("a") == list(range(8))
    mgr.free("a")


def test_lookahead_slots_are_counted(mgr: KVCacheManager) -> None:
    assert mgr.allocate_slots("a", 0, 4, num_lookahead_tokens=3)  # 7 tokens -> 2 blocks
    assert mgr.block_table("a") == [0, 1]
    mgr.free("a")


def test_prefix_hit_only_for_confirmed_full_blocks(mgr: KVCacheManager) -> None:
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    assert mgr.allocate_slots("a", 0, len(prompt))
    # Only 7 tokens confirmed so far: one full block is hashed, not two.
    mgr.cache_full_blocks("a", prompt, 7)
    assert mgr.pool.blocks[0].block_hash == hash_block(None, prompt[:4])
    assert mgr.pool.blocks[1].block_hash is None
    mgr.cache_full_blocks("a", prompt, 11)
    h1 = hash_block(hash_block(None, prompt[:4]), prompt[4:8])
    assert mgr.pool.blocks[1].block_hash == h1
    assert mgr.pool.blocks[2].block_hash is None  # partial block never hashed

    hits, n = mgr.get_computed_blocks("b", prompt)
    assert hits == [0, 1] and n == 8
    assert mgr.allocate_slots("b", n, len(prompt) - n, new_computed_blocks=hits)
    assert mgr.block_table("b") == [0, 1, 3]
    assert mgr.pool.blocks[0].ref_cnt == 2
    mgr.free("a")
    mgr.free("b")


def test_last_token_is_never_a_hit(mgr: KVCacheManager) -> None:
    prompt = list(range(8))  # exactly two blocks
    assert mgr.allocate_slots("a", 0, 8)
    mgr.cache_full_blocks("a", prompt, 8)
    mgr.free("a")
    hits, n = mgr.get_computed_blocks("b", prompt)
    assert hits == [0] and n == 4  # the second block holds the last token: recomputed


def test_hit_after_free_revives_block_and_eviction_is_lru(mgr: KVCacheManager) -> None:
    p1 = [1, 2, 3, 4, 5]
    assert mgr.allocate_slots("a", 0, 5)  # blocks 0, 1
    mgr.cache_full_blocks("a", p1, 5)
    mgr.free("a")  # 1, 0 go to the back; 0 (the prefix) is evicted last
    assert list(mgr.pool._free) == [2, 3, 4, 5, 6, 7, 1, 0]
    hits, n = mgr.get_computed_blocks("b", p1)
    assert hits == [0] and n == 4
    assert mgr.allocate_slots("b", 4, 1, new_computed_blocks=hits)
    assert mgr.block_table("b") == [0, 2]
    mgr.free("b")
    # Fill the pool: the hashed block 0 is evicted only when everything else is used.
    assert mgr.allocate_slots("c", 0, 7 * BS)
    assert 0 not in mgr.block_table("c")
    assert mgr.pool.blocks[0].block_hash is not None
    assert mgr.allocate_slots("c", 7 * BS, BS)
    assert mgr.block_table("c")[-1] == 0 and mgr.pool.blocks[0].block_hash is None
    mgr.free("c")
    assert mgr.get_computed_blocks("d", p1) == ([], 0)


def test_hit_confirmed_by_tokens_not_hash_alone(mgr: KVCacheManager) -> None:
    prompt = [7, 7, 7, 7, 8]
    assert mgr.allocate_slots("a", 0, 5)
    mgr.cache_full_blocks("a", prompt, 5)
    # Forge a colliding hash entry pointing at block 0 with different tokens.
    pool = mgr.pool
    forged = hash_block(None, [9, 9, 9, 9])
    pool._by_hash[forged] = 0
    assert pool.lookup(forged, None, [9, 9, 9, 9]) is None
    del pool._by_hash[forged]
    mgr.free("a")


def test_reviving_cached_blocks_counts_against_free_space() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    p = list(range(9))
    assert mgr.allocate_slots("a", 0, 9)
    mgr.cache_full_blocks("a", p, 9)
    mgr.free("a")
    hits, n = mgr.get_computed_blocks("b", p)
    assert n == 8
    # 2 revived + 2 new > 3 free
    assert not mgr.allocate_slots("b", n, 5, new_computed_blocks=hits)
    assert all(b.ref_cnt == 0 for b in mgr.pool.blocks) and mgr.num_free_blocks == 3
    assert mgr.allocate_slots("b", n, 1, new_computed_blocks=hits)
    mgr.free("b")
    assert mgr.num_free_blocks == 3


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    ids = pool.allocate(1)
    assert ids == [0]
    pool.free(ids)
    with pytest.raises(AssertionError):
        pool.free(ids)


def test_prefix_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    p = list(range(9))
    assert mgr.allocate_slots("a", 0, 9)
    mgr.cache_full_blocks("a", p, 9)
    mgr.free("a")
    assert mgr.get_computed_blocks("b", p) == ([], 0)
    assert mgr.num_free_blocks == 4


def _cache_prompt(mgr: KVCacheManager, rid: str, prompt: list[int], salt: str | None) -> list[int]:
    """Run `rid` over `prompt` (all confirmed), hash its full blocks, free it; returns its blocks."""
    hits, n = mgr.get_computed_blocks(rid, prompt, salt)
    assert mgr.allocate_slots(rid, n, len(prompt) - n, new_computed_blocks=hits)
    mgr.cache_full_blocks(rid, prompt, len(prompt), salt)
    table = list(mgr.block_table(rid))
    mgr.free(rid)
    return table


def test_cache_salt_isolates_prefix_blocks() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(13))  # 3 full blocks
    a = _cache_prompt(mgr, "a", prompt, "tenant-a")
    # Same tokens, another salt, or no salt: nothing cached is theirs.
    assert mgr.get_computed_blocks("b", prompt, "tenant-b") == ([], 0)
    assert mgr.get_computed_blocks("c", prompt, None) == ([], 0)
    b = _cache_prompt(mgr, "b", prompt, "tenant-b")
    assert not set(a) & set(b)
    # The same salt shares every full block (the last token is always recomputed).
    assert mgr.get_computed_blocks("a2", prompt, "tenant-a") == (a[:3], 12)
    assert mgr.get_computed_blocks("b2", prompt, "tenant-b") == (b[:3], 12)
    # Unsalted requests share among themselves, as before.
    u = _cache_prompt(mgr, "u", prompt, None)
    assert not set(u) & (set(a) | set(b))
    assert mgr.get_computed_blocks("u2", prompt, None) == (u[:3], 12)
    assert mgr.num_free_blocks == 16


def test_cache_salt_survives_a_forged_hash() -> None:
    """Even a hash that collides across salts is no hit: the salt is compared, not only hashed."""
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = [7, 7, 7, 7, 8]
    (first, _) = _cache_prompt(mgr, "a", prompt, "tenant-a")
    pool = mgr.pool
    forged = hash_block(None, prompt[:4], "tenant-b")
    pool._by_hash[forged] = first
    assert pool.lookup(forged, None, prompt[:4], "tenant-b") is None
    assert mgr.get_computed_blocks("b", prompt, "tenant-b") == ([], 0)
    assert pool.lookup(hash_block(None, prompt[:4], "tenant-a"), None, prompt[:4], "tenant-a") == first
