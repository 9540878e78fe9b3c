"""Torch references for the KV-cache write and paged attention: the CPU path of the engine.

Layout (vLLM / nano-vllm): per layer, ``k_cache`` and ``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's slot is
``block_id * block_size + offset_in_block``.

Attention is computed one sequence at a time, in float32, on exactly that sequence's tensors,
so a sequence's result never depends on which other sequences share the batch (batch
invariance: the same tokens at batch size 1 and 32). Within a sequence everything is
vectorised: its blocks are gathered once and all its new tokens and heads go through two
batched matmuls.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from itertools import pairwise

import torch

from tokentape.kernels.shapes import check_attention_shapes, check_kv_write_shapes

# Upper bound on one score matrix (new tokens x heads x context), in elements (1 MiB fp32):
# small enough that the mask, the softmax and the second bmm read it from the core's cache.
# 16 MiB chunks spent 25% more CPU on tiny's 16 x 2,048-token prefill
# (docs/benchmarks-history.md).
SCORE_ELEMENTS_PER_CHUNK = 1 << 18


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` [num_tokens, num_kv_heads, head_dim] into their slots.

    A slot of -1 means the token is not cached (e.g. padding) and is skipped.
    """
    check_kv_write_shapes(key, value, k_cache, v_cache, slot_mapping)
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    block_size = k_cache.shape[1]
    # Index by (block, offset) rather than through a flat view, so any cache strides work.
    block_ids, offsets = slots // block_size, slots % block_size
    k_cache[block_ids, offsets] = key.to(k_cache.dtype)
    v_cache[block_ids, offsets] = value.to(v_cache.dtype)


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context.

    ``query`` [total_q, num_heads, head_dim] is the ragged concatenation of the new tokens of
    B sequences (``cu_seqlens_q`` [B+1]); ``seq_lens`` [B] counts each sequence's whole
    context including these tokens, whose K/V are already in the cache. The j-th new token of
    sequence b sits at position ``seq_lens[b] - q_len_b + j`` and attends to positions up to
    its own. Returns [total_q, num_heads, head_dim] in ``query``'s dtype.
    """
    check_attention_shapes(query, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    total_q, num_heads, head_dim = query.shape
    out = torch.empty((total_q, num_heads, head_dim), dtype=torch.float32, device=query.device)
    _attend(
        query, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, scale, decodes_too=True
    )
    return out.to(query.dtype)


def prefill_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> None:
    """paged_attention_ref for the sequences with more than one new token only, written into
    their rows of ``out`` (float32, [total_q, num_heads, head_dim]); the other rows are left as
    they are. The compiled CPU kernel takes the decodes and leaves whole prompts and chunks
    here, where they go through a few large matmuls."""
    check_attention_shapes(query, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables)
    _attend(
        query, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, scale, decodes_too=False
    )


def _attend(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    decodes_too: bool,
) -> None:
    total_q, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [end - start for start, end in pairwise(starts)]
    block_ids, block_counts = _context_blocks(
        block_tables.to(k_cache.device), q_lens, lens, block_size
    )
    # Scaling is elementwise, so scaling every token at once gives each token the bits it
    # gets alone; [total_q, Hkv, G, D]: query head h reads kv head h // G.
    q_all = (query.to(torch.float32) * scale).view(total_q, num_kv_heads, group, head_dim)
    out = out.view(total_q, num_kv_heads, group, head_dim)
    # One row per block (when the cache is contiguous): a flat gather is the cheapest.
    k_rows = k_cache.flatten(1) if k_cache.is_contiguous() else k_cache
    v_rows = v_cache.flatten(1) if v_cache.is_contiguous() else v_cache
    decodes: list[int] = []
    first_block = 0
    for b, (seq_len, q_len, count) in enumerate(zip(lens, q_lens, block_counts)):
        if q_len == 1:
            decodes.append(b)
        elif q_len > 1:
            q_start, q_end = starts[b], starts[b + 1]
            blocks = block_ids[first_block : first_block + count]
            k = k_rows.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
            v = v_rows.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
            _attend_chunks(
                q_all[q_start:q_end].view(q_len, num_heads, head_dim),
                k.to(torch.float32),
                v.to(torch.float32),
                out[q_start:q_end].view(q_len, num_heads, head_dim),
                seq_len,
            )
        first_block += count
    if decodes and decodes_too:
        with torch.jit.optimized_execution(False):  # run the ops as written, nothing fused
            _decode_loop()(
                q_all, k_rows, v_rows, out, block_ids, block_counts, starts, lens, decodes
            )


def _attend_decodes(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    out: torch.Tensor,
    block_ids: torch.Tensor,
    block_counts: list[int],
    starts: list[int],
    seq_lens: list[int],
    decodes: list[int],
) -> None:
    """Attention of the decodes (one new token each) into ``out`` [total_q, Hkv, G, D].

    Sequence b's query is ``q[starts[b]]`` [Hkv, G, D] (pre-scaled, float32); its context is
    the first seq_lens[b] tokens of its cache blocks, the b-th run of ``block_counts`` ids in
    ``block_ids``, gathered from ``k_rows`` / ``v_rows`` (the caches with the block as first
    dimension). This is the hot loop of a decode step: it runs as TorchScript (see
    _decode_loop), a few torch calls per decode.
    """
    num_kv_heads, head_dim = q.shape[1], q.shape[3]
    row = num_kv_heads * head_dim
    # Split here, not in Python: tensors made in the interpreter have no Python object, and
    # handling ones that do takes the GIL back (see _decode_loop).
    blocks = block_ids.split(block_counts)
    for b in decodes:
        seq_len = seq_lens[b]
        # index_select (several times faster than advanced indexing on the CPU) makes a fresh
        # copy of the sequence's blocks, laid out the same whatever else is in the batch.
        k = k_rows.index_select(0, blocks[b]).to(torch.float32)
        v = v_rows.index_select(0, blocks[b]).to(torch.float32)
        # k.permute(1, 2, 0) and v.transpose(0, 1) of the first seq_len tokens [ctx, Hkv, D].
        k_t = k.as_strided([num_kv_heads, head_dim, seq_len], [head_dim, 1, row])
        v_t = v.as_strided([num_kv_heads, seq_len, head_dim], [head_dim, row, 1])
        scores = torch.bmm(q[starts[b]], k_t)  # [Hkv, G, ctx]
        torch.bmm(torch.softmax(scores, dim=-1), v_t, out=out[starts[b]])


@functools.cache
def _decode_loop() -> Callable[..., None]:
    """_attend_decodes compiled with TorchScript on first use: its interpreter makes the
    torch calls at a fraction of Python's cost per call (at 256 decodes of a few hundred
    tokens, a layer's attention takes ~8% less; docs/benchmarks-history.md) and runs with the GIL
    released, so the engine thread can schedule meanwhile. It takes the GIL back to handle a
    tensor that has a Python object, hence the split inside the loop. The ops, and so the
    bits, are those of the function itself.

    torch.jit.script is deprecated in favour of torch.compile, which cannot take this loop:
    it would unroll it into a graph per batch composition. Where a torch no longer scripts
    it, the plain function runs (same bits, slower)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.script(_attend_decodes)
    except Exception:  # noqa: BLE001 (any failure to compile leaves the Python loop)
        return _attend_decodes


def _context_blocks(
    block_tables: torch.Tensor, q_lens: list[int], seq_lens: list[int], block_size: int
) -> tuple[torch.Tensor, list[int]]:
    """The int64 block ids of every sequence's context, one run after another, and each run's
    length (0 for a sequence without new tokens): cut from the block table in one masked
    select rather than a slice per sequence."""
    counts = []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        if q_len > seq_len:
            raise ValueError(f"sequence {b}: {q_len} new tokens but seq_len is only {seq_len}")
        count = -(-seq_len // block_size) if q_len else 0
        if count > block_tables.shape[1]:
            raise ValueError(
                f"sequence {b}: seq_len {seq_len} needs {count} blocks but block_tables "
                f"has {block_tables.shape[1]} columns"
            )
        counts.append(count)
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = columns < torch.tensor(counts, dtype=torch.long, device=block_tables.device)[:, None]
    return block_tables[used].to(torch.long), counts


def _attend_chunks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, seq_len: int
) -> None:
    """Causal attention of q_len > 1 new tokens (q pre-scaled) into ``out`` [q_len, H, D].

    The new tokens are the last q_len positions of the seq_len in k/v [seq_len, Hkv, D]. Long
    prompts go in chunks of new tokens, bounding the score matrix, each chunk reading keys only
    up to its own last position; the chunking depends only on this sequence.
    """
    q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # [q_len, H, D] -> [Hkv, G, q_len, D]: query head h reads kv head h // G.
    q = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, ctx, D]
    chunk = max(1, SCORE_ELEMENTS_PER_CHUNK // (num_heads * seq_len))
    for j0 in range(0, q_len, chunk):
        j1 = min(q_len, j0 + chunk)
        n = j1 - j0
        key_end = seq_len - q_len + j1  # one past the chunk's last token's position
        qc = q[:, :, j0:j1].reshape(num_kv_heads, group * n, head_dim)
        kc, vc = k[:, :key_end], v[:, :key_end]
        scores = torch.bmm(qc, kc.transpose(1, 2))  # [Hkv, G * n, key_end]
        if n > 1:
            # Chunk token i sits at position key_end - n + i; later keys are masked.
            future = torch.ones(n, key_end, dtype=torch.bool, device=scores.device)
            future.triu_(key_end - n + 1)
            scores.view(num_kv_heads, group, n, key_end).masked_fill_(future, float("-inf"))
        o = torch.bmm(torch.softmax(scores, dim=-1), vc)  # [Hkv, G * n, D]
        o = o.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3)
        out[j0:j1] = o.reshape(n, num_heads, head_dim)


def lora_add_ref(
    x: torch.Tensor,
    y: torch.Tensor,
    slots: torch.Tensor,
    a: Sequence[torch.Tensor | None],
    b: Sequence[torch.Tensor | None],
) -> None:
    """In place, for each row t of x [T, in] whose slot s = slots[t] >= 0 has an adapter:
    y[t] += (x[t] @ a[s]) @ b[s], with a[s] [in, r] (LoRA's A transposed) and b[s] [r, out]
    (B transposed, times the adapter's scaling). The oracle of cpu_layers.lora_add; also what
    runs off the CPU."""
    for s in torch.unique(slots[slots >= 0]).tolist():
        a_s, b_s = a[s], b[s]
        if a_s is None or b_s is None:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        y.index_add_(0, rows, (x[rows] @ a_s) @ b_s)
