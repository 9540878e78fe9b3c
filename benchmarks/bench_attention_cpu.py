"""The engine's CPU attention path: `paged_attention_ref` against dense, unpaged attention.

The reference computes one sequence at a time (batch invariance) and gathers each sequence's
blocks from the paged cache. The baseline is torch's `scaled_dot_product_attention` on the
same K/V already laid out contiguously per sequence, the whole batch in one call: no paging,
no per-sequence loop, i.e. a lower bound for the work. Both in float32 at Qwen3-0.6B's
attention shapes (16 query heads, 8 kv heads, head_dim 128, block_size 16), one layer.
The ratio (reference / baseline) is the price of paging plus batch invariance on the CPU.

    python benchmarks/bench_attention_cpu.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import time

import _common as c
import torch
import torch.nn.functional as F

from tokentape.kernels.reference import paged_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
# name -> (batch, context length including the new tokens, new tokens per sequence)
WORKLOADS = {
    "decode, 1 x 512": (1, 512, 1),
    "decode, 32 x 512": (32, 512, 1),
    "decode, 8 x 2048": (8, 2048, 1),
    "prefill, 1 x 512": (1, 512, 512),
    "chunk, 4 x 256 after 768 cached": (4, 1024, 256),
}


def make_workload(batch: int, seq_len: int, q_len: int, gen: torch.Generator):
    blocks_per_seq = seq_len // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 16
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    tables = order.view(batch, blocks_per_seq).to(torch.int32)
    query = torch.randn(batch * q_len, NUM_HEADS, HEAD_DIM, generator=gen)
    kwargs = dict(
        cu_seqlens_q=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32),
        block_tables=tables,
        scale=HEAD_DIM**-0.5,
    )
    # The baseline's inputs: [B, H(kv), L, D], contiguous, gathered outside the timing.
    dense_k = k_cache[tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
    dense_v = v_cache[tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
    dense_q = query.view(batch, q_len, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    mask = None
    if q_len > 1:
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril_(seq_len - q_len)

    def reference() -> float:
        t0 = time.perf_counter()
        paged_attention_ref(query, k_cache, v_cache, **kwargs)
        return time.perf_counter() - t0

    def dense() -> float:
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(
            dense_q, dense_k, dense_v, attn_mask=mask, scale=kwargs["scale"], enable_gqa=True
        )
        return time.perf_counter() - t0

    return reference, dense


def main() -> None:
    args = c.parse_args(__doc__.splitlines()[0], default_repeats=5)
    gen = torch.Generator().manual_seed(0)
    rows, results = [], {}
    for name, (batch, seq_len, q_len) in WORKLOADS.items():
        reference, dense = make_workload(batch, seq_len, q_len, gen)
        with c.gc_collected():
            best = c.best_of({"reference": reference, "dense": dense}, args.repeats)
        ratio = best["reference"] / best["dense"]
        results[name] = {"reference_ms": best["reference"] * 1e3,
                         "dense_ms": best["dense"] * 1e3, "ratio": ratio}
        rows.append([name, f"{best['reference'] * 1e3:.2f}", f"{best['dense'] * 1e3:.2f}",
                     f"{ratio:.2f}x"])
    header = (f"CPU attention, one layer, float32, best of {args.repeats}; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads\n\n")
    table = c.md_table(
        ["workload", "paged_attention_ref (ms)", "dense SDPA, unpaged (ms)", "ratio"], rows
    )
    c.emit(results, header + table, args.json)


if __name__ == "__main__":
    main()
