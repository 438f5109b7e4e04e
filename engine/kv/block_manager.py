"""Array-free paged-KV bookkeeping: a block pool with LRU eviction and prefix caching (chained hashes of full
confirmed blocks, salted by `cache_salt`). Failing to allocate is a return value: the scheduler preempts."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    # What a block's hash covers, compared on every hit: tokens, the previous block's hash, the salt.
    token_ids: tuple[int, ...] = ()
    parent_hash: int | None = None
    cache_salt: str | None = None


def hash_block(parent_hash: int | None, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
    # Comparing what the hash covers on every hit: collisions cannot corrupt outputs nor cross salts. The
    # salt goes into the first block only (as in vLLM).
    if cache_salt is None:
        return hash((parent_hash, tuple(token_ids)))
    return hash((parent_hash, tuple(token_ids), cache_salt))


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order = eviction order: the front is reused first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict its cached contents
                if self._by_hash.get(block.block_hash) == block_id:
                    del self._by_hash[block.block_hash]
                block.block_hash = None
                block.token_ids = ()
                block.parent_hash = block.cache_salt = None
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
               cache_salt: str | None = None) -> int | None:
        block_id = self._by_hash.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if (block.token_ids != tuple(token_ids) or block.parent_hash != parent_hash
                or block.cache_salt != cache_salt):
            return None
        return block_id

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (reviving them from the free queue if needed)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Sequence[int]) -> None:
        # Tail-first, so a prompt's later blocks are evicted before its prefix.
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def register(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
                 cache_salt: str | None = None) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.parent_hash, block.cache_salt = parent_hash, cache_salt
        self._by_hash.setdefault(block_hash, block_id)


@dataclass(slots=True)
class _ReqBlocks:
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the leading full, confirmed blocks


class KVCacheManager:
    """Per-request block tables over one BlockPool. Token lists are the request's own lists."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._reqs: dict[str, _ReqBlocks] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    def block_table(self, request_id: str) -> list[int]:
        return self._reqs[request_id].block_ids

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            cache_salt: str | None = None) -> tuple[list[int], int]:
        """Longest cached prefix of `token_ids` under `cache_salt` in whole blocks; the last token is always
        recomputed (its step produces logits)."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        hits: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            chunk = token_ids[i * bs : (i + 1) * bs]
            salt = cache_salt if i == 0 else None
            h = hash_block(parent, chunk, salt)
            block_id = self.pool.lookup(h, parent, chunk, salt)
            if block_id is None:
                break
            hits.append(block_id)
            parent = h
        self.prefix_queries += len(token_ids)
        self.prefix_hits += len(hits) * bs
        return hits, len(hits) * bs

    def allocate_slots(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        new_computed_blocks: Sequence[int] = (),
    ) -> bool:
        """Ensure slots for `num_computed + num_new + lookahead` tokens; a new request's
        `new_computed_blocks` are its prefix-cache hits."""
        rb = self._reqs.get(request_id)
        if rb is None:
            rb = _ReqBlocks()
        num_required = self.num_blocks_needed(num_computed_tokens + num_new_tokens + num_lookahead_tokens)
        have = len(rb.block_ids) + len(new_computed_blocks)
        # Reviving cached blocks with ref 0 consumes free-queue entries too.
        revived = sum(1 for b in new_computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        need = max(0, num_required - have)
        if need + revived > self.pool.num_free:
            return False
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            rb.block_ids.extend(new_computed_blocks)
            parent = rb.block_hashes[-1] if rb.block_hashes else None
            for b in new_computed_blocks:
                block = self.pool.blocks[b]
                h = block.block_hash
                assert h is not None and block.parent_hash == parent
                assert hash_block(parent, block.token_ids, block.cache_salt) == h
                rb.block_hashes.append(h)
                parent = h
        if need:
            new = self.pool.allocate(need)
            assert new is not None
            rb.block_ids.extend(new)
        self._reqs[request_id] = rb
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_confirmed: int,
                          cache_salt: str | None = None) -> None:
        """Hash every full block of confirmed tokens (`token_ids[:num_confirmed]`)."""
        if not self.enable_prefix_caching:
            return
        rb = self._reqs[request_id]
        bs = self.block_size
        num_full = min(num_confirmed // bs, len(rb.block_ids))
        parent = rb.block_hashes[-1] if rb.block_hashes else None
        for i in range(len(rb.block_hashes), num_full):
            chunk = token_ids[i * bs : (i + 1) * bs]
            salt = cache_salt if i == 0 else None
            h = hash_block(parent, chunk, salt)
            self.pool.register(rb.block_ids[i], h, parent, chunk, salt)
            rb.block_hashes.append(h)
            parent = h

    def free(self, request_id: str) -> None:
        rb = self._reqs.pop(request_id, None)
        if rb is not None:
            self.pool.free(list(reversed(rb.block_ids)))

    def has(self, request_id: str) -> bool:
        return request_id in self._reqs

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        return self.pool.usage()
