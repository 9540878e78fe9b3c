"""The engine's CPU attention path: `paged_attention_ref` against dense, unpaged attention,
and the compiled kernels the engine runs (`kernels/cpu`, through `cpu_native`) beside.

The reference computes one sequence at a time (batch invariance) and gathers each sequence's
blocks from the paged cache. The baseline is torch's `scaled_dot_product_attention` on the
same K/V already laid out contiguously per sequence, the whole batch in one call: no paging,
no per-sequence loop, i.e. a lower bound for the work. Both in float32, one layer, block_size
16, one torch thread, at Qwen3-0.6B's attention shapes (16 query heads, 8 kv heads, head_dim
128) and at the built-in tiny model's (4, 2, 64). The ratio (reference / baseline) is the
price of paging plus batch invariance on the CPU. The compiled kernels' column gives their
time and GFLOP/s (4 x head_dim FLOPs per query head per key attended: the scores and the
weighted sum; the causal mask's other half not counted).

    python benchmarks/bench_attention_cpu.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import time
from collections.abc import Callable

import _common as c
import torch
import torch.nn.functional as F

from tokentape.kernels import cpu_native
from tokentape.kernels.reference import paged_attention_ref

BLOCK_SIZE = 16
QWEN3_06B = (16, 8, 128)  # query heads, kv heads, head_dim
TINY = (4, 2, 64)
# name -> (shapes, batch, context length including the new tokens, new tokens per sequence)
WORKLOADS = {
    "qwen3-0.6b decode, 1 x 512": (QWEN3_06B, 1, 512, 1),
    "qwen3-0.6b decode, 32 x 512": (QWEN3_06B, 32, 512, 1),
    "qwen3-0.6b decode, 8 x 2048": (QWEN3_06B, 8, 2048, 1),
    "qwen3-0.6b prefill, 1 x 512": (QWEN3_06B, 1, 512, 512),
    "qwen3-0.6b chunk, 4 x 256 after 768 cached": (QWEN3_06B, 4, 1024, 256),
    "tiny decode, 32 x 256": (TINY, 32, 256, 1),
    "tiny decode, 256 x 256": (TINY, 256, 256, 1),
    "tiny prefill, 8 x 128": (TINY, 8, 128, 128),
    "tiny prefill, 2 x 2048": (TINY, 2, 2048, 2048),
}


def make_workload(
    shapes: tuple[int, int, int], batch: int, seq_len: int, q_len: int, gen: torch.Generator
) -> tuple[Callable[[], float], Callable[[], float], Callable[[], float]]:
    num_heads, num_kv_heads, head_dim = shapes
    blocks_per_seq = seq_len // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 16
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    tables = order.view(batch, blocks_per_seq).to(torch.int32)
    query = torch.randn(batch * q_len, num_heads, head_dim, generator=gen)
    kwargs = {
        "cu_seqlens_q": torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32),
        "seq_lens": torch.full((batch,), seq_len, dtype=torch.int32),
        "block_tables": tables,
        "scale": head_dim**-0.5,
    }
    # The baseline's inputs: [B, H(kv), L, D], contiguous, gathered outside the timing.
    dense_k = k_cache[tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
    dense_v = v_cache[tables.long()].flatten(1, 2).transpose(1, 2).contiguous()
    dense_q = query.view(batch, q_len, num_heads, head_dim).transpose(1, 2).contiguous()
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

    def compiled() -> float:
        t0 = time.perf_counter()
        cpu_native.paged_attention_cpu(query, k_cache, v_cache, **kwargs)
        return time.perf_counter() - t0

    return reference, dense, compiled


def attention_flop(shapes: tuple[int, int, int], batch: int, seq_len: int, q_len: int) -> float:
    """4 x head_dim FLOPs per query head per key it attends (causally)."""
    num_heads, _, head_dim = shapes
    keys = q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2
    return 4.0 * head_dim * num_heads * batch * keys


def main() -> None:
    args = c.parse_args(__doc__.splitlines()[0], default_repeats=5)
    # One thread, as the engine runs the tiny model (and as transformers runs in (g)): on
    # this 2-core machine a second OpenMP thread mostly adds fork/join to each small op.
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    rows, results = [], {}
    have_compiled = cpu_native.load() is not None
    for name, (shapes, batch, seq_len, q_len) in WORKLOADS.items():
        reference, dense, compiled = make_workload(shapes, batch, seq_len, q_len, gen)
        variants = {"reference": reference, "dense": dense}
        if have_compiled:
            variants["compiled"] = compiled
        with c.gc_collected():
            best = c.best_of(variants, args.repeats)
        ratio = best["reference"] / best["dense"]
        results[name] = {
            "reference_ms": best["reference"] * 1e3,
            "dense_ms": best["dense"] * 1e3,
            "ratio": ratio,
        }
        row = [
            name,
            f"{best['reference'] * 1e3:.2f}",
            f"{best['dense'] * 1e3:.2f}",
            f"{ratio:.2f}x",
        ]
        if have_compiled:
            gflop_s = attention_flop(shapes, batch, seq_len, q_len) / best["compiled"] / 1e9
            results[name] |= {"compiled_ms": best["compiled"] * 1e3, "compiled_gflop_s": gflop_s}
            row += [f"{best['compiled'] * 1e3:.2f}", f"{gflop_s:.0f}"]
        rows.append(row)
    header = (
        f"CPU attention, one layer, float32, best of {args.repeats}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads\n\n"
    )
    headers = ["workload", "paged_attention_ref (ms)", "dense SDPA, unpaged (ms)", "ratio"]
    if have_compiled:
        headers += ["compiled kernels (ms)", "compiled GFLOP/s"]
    table = c.md_table(headers, rows)
    c.emit(results, header + table, args.json)


if __name__ == "__main__":
    main()
