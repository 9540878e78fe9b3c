"""Paged KV blocks with a prefix cache, as in vLLM V1's block pool.

Blocks are reference counted. A block whose count drops to zero goes to the back of the free
queue but keeps its hash, so a later request with the same prefix can take it back (a cache
hit); allocation evicts from the front, least recently freed first. Only full blocks of
*confirmed* tokens (prompt and delivered output, never placeholders) are hashed, as a chain:
each block's hash covers its parent's hash and its own tokens.

A hit is trusted on the hash alone, so the hash is SHA-256, as vLLM's after CVE-2025-25183:
with a 64-bit hash (Python's `hash()`), prompts can be crafted whose blocks collide, and one
request would read another's K/V. A block's hash is
`sha256(parent hash || its tokens as little-endian int64)`, the first block's parent being 32
zero bytes; it is computed once per full block and kept with the request. A request that runs
with a LoRA adapter computes other K/V for the same tokens: its first block's parent is
`sha256(32 zero bytes || the adapter's content hash)` instead, as vLLM keys its blocks by the
adapter too.

This is resource bookkeeping on the decide side. Which blocks a request holds is request
state and lives in the reducer (`RequestState.block_ids`); the scheduler records every
allocation on the tape.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from mypy_extensions import mypyc_attr

from tokentape.events.schema import KVCacheSnapshot
from tokentape.events.state import RequestState

ROOT_BLOCK_HASH = bytes(32)  # the parent of every request's first block
# What allocate gives a request whose blocks have room, shared (never mutated: the scheduler
# records it in a ScheduledEntry, whose readers only read), so that a decode step does not
# allocate an empty list per request.
NO_BLOCKS: list[int] = []


# Subclassable from Python although compiled: a test injects a fault into a real manager so.
@mypyc_attr(allow_interpreted_subclasses=True)
class KVCacheManager:
    """The paged KV cache's bookkeeping (the blocks, not their contents): owns the reference
    count of every block, the queue of free blocks (least recently freed first, so cached
    blocks survive longest), and the prefix cache (block hash -> block, by a chain of hashes
    of confirmed tokens only). The scheduler asks it for blocks; the runner owns the tensors."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._req_hashes: dict[str, list[bytes]] = {}  # hash chain over each request's full blocks
        self._pack_block = struct.Struct(
            f"<{block_size}q"
        ).pack  # a full block's tokens, fixed width
        self._num_cached: dict[str, int] = {}  # how many of a request's held blocks are hashed
        self._lora_roots: dict[str, bytes] = {}  # LoRA adapter content hash -> root (_root)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    # -- prefix cache ------------------------------------------------------------------------

    def _block_hashes(self, req: RequestState, num_full_blocks: int) -> list[bytes]:
        hashes = self._req_hashes.setdefault(req.req_id, [])
        if len(hashes) < num_full_blocks:
            bs = self.block_size
            start = len(hashes) * bs  # only the blocks not hashed yet
            tokens = req.token_ids_between(start, num_full_blocks * bs)
            parent = hashes[-1] if hashes else self._root(req.lora_adapter_id)
            pack = self._pack_block
            for i in range(0, len(tokens), bs):
                # Fixed-width fields: the bytes hashed determine the parent and the tokens.
                parent = hashlib.sha256(parent + pack(*tokens[i : i + bs])).digest()
                hashes.append(parent)
        # The chain may already be longer (a preempted request whose length is a multiple of
        # the block size): callers get exactly the blocks they asked for.
        return hashes if len(hashes) <= num_full_blocks else hashes[:num_full_blocks]

    def _root(self, adapter_id: str) -> bytes:
        """The parent hash of a request's first block: salted with its LoRA adapter's."""
        if not adapter_id:
            return ROOT_BLOCK_HASH
        root = self._lora_roots.get(adapter_id)
        if root is None:
            root = hashlib.sha256(ROOT_BLOCK_HASH + bytes.fromhex(adapter_id)).digest()
            self._lora_roots[adapter_id] = root
        return root

    def get_computed_blocks(self, req: RequestState) -> list[int]:
        """Cached blocks holding a prefix of the request's confirmed tokens.

        At least one token is always left to compute, so the step still samples.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        # Never hit the last token's block, or nothing would be left to run.
        for h in self._block_hashes(req, max_blocks):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(
        self, req: RequestState, held: list[int], new_blocks: list[int], num_computed: int
    ) -> None:
        """Hash the full blocks of `held + new_blocks` whose tokens are computed and confirmed."""
        if not self.enable_prefix_caching:
            return
        done = self._num_cached.get(req.req_id, 0)
        if num_computed // self.block_size <= done:
            return  # no block filled up since the last call: the common decode step
        num_full = min(num_computed, req.num_tokens) // self.block_size
        if num_full <= done:
            return
        hashes = self._block_hashes(req, num_full)
        block_ids = held + new_blocks
        for i in range(done, num_full):
            block, h = block_ids[i], hashes[i]
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block
        self._num_cached[req.req_id] = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is in use, as in vLLM."""
        if self.num_used_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self._req_hashes.clear()
        self._num_cached.clear()
        return True

    # -- allocation --------------------------------------------------------------------------

    def allocate(self, held: int, num_tokens: int, hits: list[int] = ()) -> list[int] | None:  # type: ignore[assignment]
        """Take cache hits and new blocks so that `num_tokens` fit; None if there are too few.

        `held` is how many blocks the request already holds; `hits` come from
        get_computed_blocks and are returned first, followed by the newly allocated blocks.
        """
        num_new = -(-num_tokens // self.block_size) - held - len(hits)
        if num_new <= 0 and not hits:
            return NO_BLOCKS  # the blocks it holds have room: the common decode step
        free_hits = sum(1 for b in hits if self.ref_cnt[b] == 0)
        if num_new > len(self.free_queue) - free_hits:
            return None
        for b in hits:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
        new_blocks = []
        for _ in range(max(num_new, 0)):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict the cached content this block held
                self.block_hash[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
            self.ref_cnt[b] = 1
            new_blocks.append(b)
        return list(hits) + new_blocks

    def free(self, req_id: str, block_ids: list[int]) -> None:
        """Release a request's blocks (on preemption, finish or abort)."""
        self._num_cached.pop(req_id, None)
        # In reverse, so that a request's tail blocks are evicted before its prefix.
        for b in reversed(block_ids):
            cnt = self.ref_cnt[b] - 1
            if cnt < 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self.ref_cnt[b] = cnt
            if cnt == 0:
                self.free_queue[b] = None

    def forget_request(self, req_id: str) -> None:
        """Drop a finished request's hash chain."""
        self._req_hashes.pop(req_id, None)

    # -- snapshots (a segment of a segmented tape opens with one) -----------------------------

    def snapshot(self) -> KVCacheSnapshot:
        runs: list[tuple[int, int]] = []
        first = count = 0
        for b in self.free_queue:
            if count and b == first + count:
                count += 1
                continue
            if count:
                runs.append((first, count))
            first, count = b, 1
        if count:
            runs.append((first, count))
        return KVCacheSnapshot(
            runs,
            [(b, n) for b, n in enumerate(self.ref_cnt) if n],
            [(b, h) for h, b in self.cached.items()],
            list(self._num_cached.items()),
        )

    def restore(self, snap: KVCacheSnapshot) -> None:
        """Take the bookkeeping a snapshot holds; the hash chains are computed again from the
        requests' tokens when needed."""
        self.ref_cnt = [0] * self.num_blocks
        for b, n in snap.ref_counts:
            self.ref_cnt[b] = n
        self.block_hash = [None] * self.num_blocks
        self.cached = {}
        for b, h in snap.cached_blocks:
            self.block_hash[b] = h
            self.cached[h] = b
        self.free_queue = OrderedDict.fromkeys(
            b for first, count in snap.free_runs for b in range(first, first + count)
        )
        self._req_hashes = {}
        self._num_cached = dict(snap.num_cached)
