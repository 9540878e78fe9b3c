"""GPU check: the Triton kernels against their torch references on CUDA, then the engine.

One short script for a machine with a CUDA GPU (a few minutes at most):

1. correctness, bfloat16, at Qwen3-0.6B's attention shapes (16 query heads, 8 kv heads,
   head_dim 128, block_size 16): the KV-cache write (must be exact), the decode kernel on a
   batch of ragged contexts, the prefill kernel on a mix of whole prompts, chunks after a
   cached prefix and decodes, plus float32 runs and a batch-invariance check of the kernels;
2. timing: the decode kernel against the torch reference and against torch's dense
   ``scaled_dot_product_attention`` on the same K/V laid out contiguously (no paging: a
   speed-of-light baseline), and the prefill kernel against the reference; then the fused
   pass (the decoder's row operations as Triton kernels) against the modules' own ops, both
   measured against float32, and the decode steps' CUDA graphs on the whole model, each
   replay against the eager pass, all three timed;
3. the engine benchmark, ``benchmarks/bench_generate.py --device cuda --dtype bfloat16
   --config qwen3-0.6b``, run as a subprocess when that file exists, its output printed.

Ends with a compact summary; exit status 1 if a check failed. Without CUDA it says so and
exits 0 having checked nothing. Two modes need no GPU: ``--compile-only`` compiles every
kernel ahead of time for ``--arch`` (default sm_90) with the engine's launch parameters and
reports registers and spills; ``--cpu-interpret`` runs parts 1 and 2 on the CPU under the
Triton interpreter with tiny shapes, to smoke-test this script.

    python benchmarks/gpu_check.py [--skip-engine] [--engine-timeout 300] [--engine-args '...']
    python benchmarks/gpu_check.py --compile-only [--arch 90]
    python benchmarks/gpu_check.py --cpu-interpret
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch  # does not import triton: TRITON_INTERPRET can still be set below

if TYPE_CHECKING:
    from tokentape.engine.runners.input_batch import ForwardBatch

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    block_size: int
    decode_seq_lens: tuple[int, ...]  # one new token each
    mixed_seqs: tuple[tuple[int, int], ...]  # (seq_len, q_len)
    timing_batch: int
    timing_context: int


QWEN3_06B = Shapes(
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    hidden_size=1024,
    block_size=16,
    decode_seq_lens=(1, 15, 16, 17, 100, 511, 1024, 2047, 4096, 3000, 77, 250) * 3,
    mixed_seqs=((512, 512), (1000, 200), (2048, 1), (33, 33), (700, 1), (1500, 300), (17, 16)),
    timing_batch=32,
    timing_context=1024,
)
TINY = Shapes(
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    hidden_size=64,
    block_size=4,
    decode_seq_lens=(1, 3, 4, 5, 40, 300),
    mixed_seqs=((12, 12), (20, 7), (30, 1), (5, 4)),
    timing_batch=2,
    timing_context=64,
)
# (rtol, atol) as in torch.testing: |out - ref| <= atol + rtol * |ref|. A bf16 output is
# rounded to 8 significant bits; fp32 inputs use IEEE fp32 dots (no tf32), so 1e-4 is generous.
BF16_TOLERANCE = (1.6e-2, 1e-2)
FP32_TOLERANCE = (1e-4, 1e-4)


@dataclass
class Result:
    name: str
    ok: bool | None  # None: informational
    detail: str


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Check the Triton kernels against the torch references on CUDA, time "
        "them, and run the engine benchmark (benchmarks/bench_generate.py) if present."
    )
    p.add_argument("--skip-engine", action="store_true", help="do not run bench_generate.py")
    p.add_argument(
        "--engine-timeout",
        type=float,
        default=300.0,
        help="seconds allowed for the engine benchmark subprocess (default 300)",
    )
    p.add_argument(
        "--engine-args",
        default="",
        help="extra arguments for bench_generate.py, e.g. '--num-prompts 64 --skip-hf'",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=50,
        help="timed iterations per variant, median reported (default 50)",
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="no GPU needed: compile every kernel ahead of time for --arch with the "
        "launch parameters the engine uses (catches what the interpreter cannot: "
        "compile errors, and register spills where cuobjdump is available)",
    )
    p.add_argument(
        "--arch",
        type=int,
        default=90,
        help="CUDA compute capability for --compile-only, e.g. 80, 90 (default 90)",
    )
    p.add_argument(
        "--cpu-interpret",
        action="store_true",
        help="smoke-test this script without a GPU: the Triton interpreter on the "
        "CPU with tiny shapes (timings meaningless, no engine run)",
    )
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.compile_only:
        return summarize(compile_kernels(args.arch))
    if args.cpu_interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        os.environ["TOKENTAPE_KERNELS"] = "triton"  # the model's passes too, on the CPU
        device, shapes, iters = torch.device("cpu"), TINY, 2
    elif torch.cuda.is_available():
        device, shapes, iters = torch.device("cuda"), QWEN3_06B, args.iters
    else:
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}); nothing checked. --cpu-interpret runs the "
            "kernel checks on the CPU under the Triton interpreter."
        )
        return 0
    from tokentape.kernels import triton_available

    if not triton_available():
        print("gpu_check: triton is not installed: pip install -e '.[cuda]'")
        return 1
    print(f"gpu_check: {describe(device)}")
    results: list[Result] = []
    gen = torch.Generator(device=device).manual_seed(0)
    results += stage("kv write", lambda: check_kv_write(device, shapes, gen))
    for dtype, tol in ((torch.bfloat16, BF16_TOLERANCE), (torch.float32, FP32_TOLERANCE)):
        results += stage(
            f"attention {dtype_name(dtype)}",
            partial(check_attention, device, shapes, dtype, tol, gen),
        )
    results += stage("batch invariance", lambda: check_batch_invariance(device, shapes, gen))
    results += stage("timing", lambda: time_kernels(device, shapes, iters, gen))
    if device.type == "cuda":
        results += stage(
            "fused pass",
            lambda: check_fused_pass(device, "qwen3-0.6b", torch.bfloat16, (1, 7, 64)),
        )
        results += stage("cuda graphs", lambda: check_cuda_graphs(device, iters))
    else:  # the interpreter: float16 (its bfloat16 math is float32's), the tiny model
        results += stage(
            "fused pass", lambda: check_fused_pass(device, "tiny", torch.float16, (1, 3))
        )
    if not (args.skip_engine or args.cpu_interpret):
        results.append(run_engine_benchmark(args.engine_timeout, shlex.split(args.engine_args)))
    return summarize(results)


def stage(name: str, run: Callable[[], list[Result]]) -> list[Result]:
    """Run one part; an exception is a FAIL in the summary and the later parts still run."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 (the error is the finding: report it, go on)
        traceback.print_exc()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return [Result(name, False, f"raised {type(exc).__name__}: {first[:160]}")]


def summarize(results: list[Result]) -> int:
    print("\n== summary ==")
    for r in results:
        tag = "info" if r.ok is None else ("PASS" if r.ok else "FAIL")
        print(f"{tag:4}  {r.name}: {r.detail}")
    failed = [r.name for r in results if r.ok is False]
    print(f"{len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def compile_kernels(arch: int) -> list[Result]:
    """Compile each kernel for sm_<arch> as the launchers would, at Qwen3-0.6B's shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tokentape.kernels import triton_decode, triton_kv_write, triton_layers, triton_prefill

    s = QWEN3_06B
    results = []
    for dtype, ptr in ((torch.bfloat16, "*bf16"), (torch.float32, "*fp32")):
        index = {
            "slot_mapping_ptr": "*i64",
            "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "cu_seqlens_q_ptr": "*i32",
            "partial_out_ptr": "*fp32",
            "partial_max_ptr": "*fp32",
            "partial_sum_ptr": "*fp32",
            "qk_scale": "fp32",
            "eps": "fp32",
            "cos_ptr": "*fp32",
            "sin_ptr": "*fp32",
            "positions_ptr": "*i64",
        }
        kernels = [
            (
                "kv write",
                triton_kv_write._write_kv_cache_kernel,
                triton_kv_write.kv_write_kernel_meta(s.num_kv_heads, s.head_dim),
            ),
            (
                "decode split",
                triton_decode._decode_split_kernel,
                triton_decode.split_kernel_meta(
                    s.num_heads, s.num_kv_heads, s.head_dim, dtype, num_splits=4
                ),
            ),
            (
                "decode single split",
                triton_decode._decode_split_kernel,
                triton_decode.split_kernel_meta(
                    s.num_heads, s.num_kv_heads, s.head_dim, dtype, num_splits=1
                ),
            ),
            (
                "decode merge",
                triton_decode._decode_merge_kernel,
                triton_decode.merge_kernel_meta(s.head_dim, num_splits=4),
            ),
            (
                "prefill",
                triton_prefill._prefill_kernel,
                triton_prefill.prefill_kernel_meta(s.num_heads, s.num_kv_heads, s.head_dim, dtype),
            ),
            (
                "add rms norm",
                triton_layers._add_rms_norm_kernel,
                {**triton_layers.rms_norm_kernel_meta(s.hidden_size), "HAS_RESIDUAL": True},
            ),
            (
                "qk norm rope",
                triton_layers._qk_norm_rope_kernel,
                triton_layers.qk_norm_rope_kernel_meta(s.head_dim, norm=True),
            ),
            ("silu mul", triton_layers._silu_mul_kernel, {"BLOCK": triton_layers.SILU_BLOCK}),
        ]
        for name, kernel, meta in kernels:
            meta = dict(meta)
            options = {"num_warps": meta.pop("num_warps", 4)}
            signature = {}
            for arg in kernel.arg_names:
                if arg in meta:
                    signature[arg] = "constexpr"
                elif arg.endswith("_ptr"):
                    signature[arg] = index.get(arg, ptr)
                else:
                    signature[arg] = index.get(arg, "i32")
            # Launches pass 16-byte-aligned pointers, which triton specializes on.
            attrs = {
                (i,): [["tt.divisibility", 16]]
                for i, arg in enumerate(kernel.arg_names)
                if arg.endswith("_ptr")
            }
            label = f"compile {name} {dtype_name(dtype)} sm_{arch}"
            start = time.perf_counter()
            try:
                compiled = triton.compile(
                    ASTSource(kernel, signature, constexprs=meta, attrs=attrs),
                    target=GPUTarget("cuda", arch, 32),
                    options=options,
                )
            except Exception as exc:  # noqa: BLE001 (a compile error is the finding: report it)
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                results.append(Result(label, False, f"{type(exc).__name__}: {first[:160]}"))
                continue
            usage = resource_usage(compiled.asm.get("cubin", b""))
            results.append(
                Result(
                    label,
                    True,
                    f"{time.perf_counter() - start:.1f} s, {options['num_warps']} warps, "
                    f"{compiled.metadata.shared} B shared" + (f", {usage}" if usage else ""),
                )
            )
    return results


def resource_usage(cubin: bytes) -> str:
    """Registers and spill stack per thread, from the cuobjdump triton ships (if present)."""
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cubin or not tool.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=False
        ).stdout
    fields = dict(
        item.split(":", 1)
        for line in out.splitlines()
        if "REG:" in line
        for item in line.split()
        if ":" in item
    )
    if "REG" not in fields:
        return ""
    return f"{fields['REG']} registers, {fields.get('STACK', '?')} B stack (spills if > 0)"


def describe(device: torch.device) -> str:
    import triton

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        where = f"{name}, CUDA {torch.version.cuda}"
    else:
        where = "CPU, Triton interpreter"
    return f"{where}; torch {torch.__version__}, triton {triton.__version__}"


def paged_batch(
    device: torch.device,
    shapes: Shapes,
    seqs: list[tuple[int, int]],
    dtype: torch.dtype,
    gen: torch.Generator,
    spare_blocks: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Random cache and query for ``seqs`` [(seq_len, q_len)], blocks handed out shuffled."""
    bs = shapes.block_size
    blocks_per_seq = [-(-seq_len // bs) for seq_len, _ in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    cache_shape = (num_blocks, bs, shapes.num_kv_heads, shapes.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    width = max(blocks_per_seq) + 2
    # Padding entries are never read: fill them with the last block id, a valid wrong one.
    tables = torch.full((len(seqs), width), num_blocks - 1, dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = order[used : used + n]
        used += n
    q_lens = [q for _, q in seqs]
    cu = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    query = torch.randn(
        sum(q_lens), shapes.num_heads, shapes.head_dim, generator=gen, device=device
    ).to(dtype)
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device)
    kwargs = {
        "cu_seqlens_q": cu,
        "seq_lens": seq_lens,
        "block_tables": tables,
        "scale": shapes.head_dim**-0.5,
    }
    return query, k_cache, v_cache, kwargs


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def check_kv_write(device: torch.device, shapes: Shapes, gen: torch.Generator) -> list[Result]:
    from tokentape.kernels.reference import write_kv_cache_ref
    from tokentape.kernels.triton_kv_write import write_kv_cache_triton

    results = []
    for dtype in (torch.bfloat16, torch.float32):
        num_blocks, bs = 64, shapes.block_size
        shape = (num_blocks, bs, shapes.num_kv_heads, shapes.head_dim)
        k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
        v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
        num_tokens = num_blocks * bs // 2
        slots = torch.randperm(num_blocks * bs, generator=gen, device=device)[:num_tokens]
        slots[::7] = -1
        key = torch.randn(num_tokens, *shape[2:], generator=gen, device=device).to(dtype)
        value = torch.randn(num_tokens, *shape[2:], generator=gen, device=device).to(dtype)
        expected_k, expected_v = k_cache.clone(), v_cache.clone()
        write_kv_cache_ref(key, value, expected_k, expected_v, slots)
        write_kv_cache_triton(key, value, k_cache, v_cache, slots)
        err = max(max_error(k_cache, expected_k), max_error(v_cache, expected_v))
        results.append(
            Result(
                f"kv write {dtype_name(dtype)}",
                err == 0.0,
                f"{num_tokens} tokens, max error {err:.1e} (must be 0)",
            )
        )
    return results


def check_attention(
    device: torch.device,
    shapes: Shapes,
    dtype: torch.dtype,
    tol: tuple[float, float],
    gen: torch.Generator,
) -> list[Result]:
    from tokentape.kernels.reference import paged_attention_ref
    from tokentape.kernels.triton_decode import paged_decode_triton
    from tokentape.kernels.triton_prefill import paged_prefill_triton

    results = []
    decodes = [(s, 1) for s in shapes.decode_seq_lens]
    for label, seqs, kernel in (
        ("decode", decodes, paged_decode_triton),
        ("prefill+decode mix", list(shapes.mixed_seqs), paged_prefill_triton),
        ("prefill kernel on decodes", decodes, paged_prefill_triton),
    ):
        query, k_cache, v_cache, kwargs = paged_batch(device, shapes, seqs, dtype, gen)
        # The reference on the same low-precision inputs, in float32.
        expected = paged_attention_ref(query.float(), k_cache.float(), v_cache.float(), **kwargs)
        out = kernel(query, k_cache, v_cache, **kwargs)
        err = max_error(out, expected)
        rtol, atol = tol
        excess = ((out.float() - expected).abs() - rtol * expected.abs()).max().item()
        ok = excess <= atol and out.dtype == dtype
        results.append(
            Result(
                f"{label} {dtype_name(dtype)}",
                ok,
                f"{len(seqs)} seqs, {query.shape[0]} new tokens, max |err| {err:.2e} "
                f"(rtol {rtol:.1e}, atol {atol:.0e})",
            )
        )
    return results


def check_batch_invariance(
    device: torch.device, shapes: Shapes, gen: torch.Generator
) -> list[Result]:
    """Informational: a sequence alone vs in a batch, bit for bit, through each kernel."""
    from tokentape.kernels.triton_decode import paged_decode_triton
    from tokentape.kernels.triton_prefill import paged_prefill_triton

    results = []
    decodes = [(s, 1) for s in shapes.decode_seq_lens]
    for label, seqs, kernel in (
        ("decode", decodes, paged_decode_triton),
        ("prefill", list(shapes.mixed_seqs), paged_prefill_triton),
    ):
        query, k_cache, v_cache, kwargs = paged_batch(device, shapes, seqs, torch.bfloat16, gen)
        batched = kernel(query, k_cache, v_cache, **kwargs)
        cu = kwargs["cu_seqlens_q"].tolist()
        same = 0
        for i in range(len(seqs)):
            alone = kernel(
                query[cu[i] : cu[i + 1]],
                k_cache,
                v_cache,
                cu_seqlens_q=torch.tensor([0, cu[i + 1] - cu[i]], dtype=torch.int32, device=device),
                seq_lens=kwargs["seq_lens"][i : i + 1],
                block_tables=kwargs["block_tables"][i : i + 1],
                scale=kwargs["scale"],
            )
            same += bool(torch.equal(alone, batched[cu[i] : cu[i + 1]]))
        results.append(
            Result(
                f"batch invariance, {label} kernel",
                None,
                f"{same}/{len(seqs)} sequences bit-identical alone and batched",
            )
        )
    return results


def time_kernels(
    device: torch.device, shapes: Shapes, iters: int, gen: torch.Generator
) -> list[Result]:
    import torch.nn.functional as F

    from tokentape.kernels.reference import paged_attention_ref
    from tokentape.kernels.triton_decode import paged_decode_triton
    from tokentape.kernels.triton_prefill import paged_prefill_triton

    batch, context = shapes.timing_batch, shapes.timing_context
    seqs = [(context, 1)] * batch
    query, k_cache, v_cache, kwargs = paged_batch(device, shapes, seqs, torch.bfloat16, gen)
    # The same K/V gathered contiguously, for the dense baseline: [B, Hkv, context, D].
    tables = kwargs["block_tables"][:, : context // shapes.block_size].long()
    dense_k = k_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    dense_v = v_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    dense_q = query.unsqueeze(2)  # [B, H, 1, D]
    gqa: dict[str, Any] = {"enable_gqa": True}
    try:
        F.scaled_dot_product_attention(dense_q, dense_k, dense_v, scale=kwargs["scale"], **gqa)
    except TypeError:  # torch < 2.5: no enable_gqa; repeat the kv heads instead
        group = shapes.num_heads // shapes.num_kv_heads
        dense_k = dense_k.repeat_interleave(group, dim=1)
        dense_v = dense_v.repeat_interleave(group, dim=1)
        gqa = {}
    scale = kwargs["scale"]
    variants: dict[str, Callable[[], object]] = {
        "decode kernel": lambda: paged_decode_triton(query, k_cache, v_cache, **kwargs),
        "reference": lambda: paged_attention_ref(query, k_cache, v_cache, **kwargs),
        "dense SDPA (no paging)": lambda: F.scaled_dot_product_attention(
            dense_q, dense_k, dense_v, scale=scale, **gqa
        ),
    }
    timings = {name: median_ms(fn, device, iters) for name, fn in variants.items()}
    base = timings["decode kernel"]
    detail = ", ".join(f"{name} {ms:.3f} ms ({ms / base:.1f}x)" for name, ms in timings.items())
    results = [Result(f"decode timing B={batch} ctx={context} bf16", None, detail)]

    seqs = [(2 * context, context)] * 4  # 4 chunks of `context` tokens after as many cached
    query, k_cache, v_cache, kwargs = paged_batch(device, shapes, seqs, torch.bfloat16, gen)
    prefill = median_ms(
        lambda: paged_prefill_triton(query, k_cache, v_cache, **kwargs), device, iters
    )
    ref = median_ms(
        lambda: paged_attention_ref(query, k_cache, v_cache, **kwargs), device, max(2, iters // 5)
    )
    results.append(
        Result(
            f"prefill timing 4 x {context} new after {context} cached, bf16",
            None,
            f"prefill kernel {prefill:.3f} ms, reference {ref:.3f} ms ({ref / prefill:.1f}x)",
        )
    )
    return results


def decode_batch(
    n: int,
    vocab_size: int,
    kv_blocks: int,
    block_size: int,
    width: int,
    device: torch.device,
    rng: random.Random,
) -> ForwardBatch:
    """`n` decodes at random contexts of up to `width` blocks, on distinct random blocks."""
    from tokentape.engine.model.decoder import AttentionMetadata
    from tokentape.engine.runners.input_batch import ForwardBatch

    contexts = [rng.randint(1, width * block_size) for _ in range(n)]
    blocks = rng.sample(range(kv_blocks), sum(-(-c // block_size) for c in contexts))
    tables, slots, used = [], [], 0
    for c in contexts:
        table = blocks[used : used + -(-c // block_size)]
        used += len(table)
        slots.append(table[(c - 1) // block_size] * block_size + (c - 1) % block_size)
        tables.append(table + [0] * (width - len(table)))

    def on(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return ForwardBatch(
        input_ids=on([rng.randrange(vocab_size) for _ in range(n)], torch.int64),
        positions=on([c - 1 for c in contexts], torch.int64),
        meta=AttentionMetadata(
            slot_mapping=on(slots, torch.int64),
            cu_seqlens_q=on(list(range(n + 1)), torch.int32),
            seq_lens=on(contexts, torch.int32),
            block_tables=on(tables, torch.int32),
        ),
        sample_rows=on(list(range(n)), torch.int64),
    )


def random_kv(
    config: Any, kv_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (kv_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [
        (
            torch.randn(shape, device=device, dtype=dtype),
            torch.randn(shape, device=device, dtype=dtype),
        )
        for _ in range(config.num_hidden_layers)
    ]


def modules_pass(
    model: Any, b: ForwardBatch, kv: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """The model's pass over `b` through its modules' own ops (the fused pass's oracle)."""
    model.fused = False
    try:
        return model(b.input_ids, b.positions, kv, b.meta)  # type: ignore[no-any-return]
    finally:
        model.fused = True


def row_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    """The largest relative L2 error of a row of `got` against `truth`."""
    got, truth = got.float(), truth.float()
    return ((got - truth).norm(dim=-1) / truth.norm(dim=-1)).max().item()


def check_fused_pass(
    device: torch.device, config_name: str, dtype: torch.dtype, sizes: tuple[int, ...]
) -> list[Result]:
    """The fused pass (kernels/triton_layers.py) against the modules' own ops, both in `dtype`
    and both measured against the modules in float32 on the same weights and the same cache:
    over a deep model two orders of rounding part, so the test is that the fused pass is not
    further from float32 than the modules are (at most 1.25x their error)."""
    import copy

    from tokentape.engine.model.loader import builtin_model

    config, truth_model = builtin_model(config_name, 0)
    truth_model = truth_model.to(device).eval()
    model = copy.deepcopy(truth_model).to(dtype)
    block_size, width = 16, 16  # contexts up to 256 tokens
    kv_blocks = width * max(sizes)
    kv = random_kv(config, kv_blocks, block_size, dtype, device)
    kv_truth = [(k.float(), v.float()) for k, v in kv]  # the same values
    rng = random.Random(0)
    results = []
    with torch.inference_mode():
        for n in sizes:
            b = decode_batch(n, config.vocab_size, kv_blocks, block_size, width, device, rng)
            truth = modules_pass(truth_model, b, kv_truth)
            modules = modules_pass(model, b, kv)
            fused = model(b.input_ids, b.positions, kv, b.meta)
            ours, theirs = row_error(fused, truth), row_error(modules, truth)
            results.append(
                Result(
                    f"fused pass, batch {n}, {config_name} {dtype_name(dtype)}",
                    ours <= 1.25 * theirs,
                    f"largest row error against float32 {ours:.2e}, the modules' {theirs:.2e} "
                    f"({ours / theirs:.2f}x, <= 1.25x)",
                )
            )
    return results


def check_cuda_graphs(device: torch.device, iters: int) -> list[Result]:
    """The decode steps' CUDA graphs (tokentape/engine/runners/cuda_graphs.py) on the whole
    qwen3-0.6b model, seeded weights, bfloat16: each replay against the eager pass over the
    same batch (batches of 5 and 7 share the size-8 graph, so the second replay must read its
    own inputs), then the time of a decode pass at batch 1 and 64: the modules' ops, the
    fused pass, and its graph."""
    from tokentape.engine.model.loader import builtin_model
    from tokentape.engine.runners.cuda_graphs import CUDAGraphRunner

    config, model = builtin_model("qwen3-0.6b", 0)
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    block_size, kv_blocks, width = 16, 8192, 128  # contexts up to 2,048 tokens
    kv = random_kv(config, kv_blocks, block_size, torch.bfloat16, device)
    graphs = CUDAGraphRunner(model, 64, width, device)
    rng = random.Random(0)

    def batch_of(n: int) -> ForwardBatch:
        return decode_batch(n, config.vocab_size, kv_blocks, block_size, width, device, rng)

    results = []
    with torch.inference_mode():
        for n in (5, 7, 64, 1):
            batch = batch_of(n)
            # Both passes write the same K/V for the batch's rows; the order does not matter.
            eager = model(batch.input_ids, batch.positions, kv, batch.meta).float()
            replayed = graphs.forward(batch, kv).float()
            cosine = torch.nn.functional.cosine_similarity(eager, replayed, dim=-1).min().item()
            results.append(
                Result(
                    f"cuda graph replay, batch {n}",
                    cosine >= 0.999,
                    f"size-{graphs.capture_size(n)} graph; max |err| "
                    f"{max_error(eager, replayed):.2e}, lowest cosine per row {cosine:.5f} "
                    "(>= 0.999)",
                )
            )
        for n in (1, 64):
            batch = batch_of(n)
            modules_ms = median_ms(lambda b=batch: modules_pass(model, b, kv), device, iters)
            eager_ms = median_ms(
                lambda b=batch: model(b.input_ids, b.positions, kv, b.meta), device, iters
            )
            graph_ms = median_ms(lambda b=batch: graphs.forward(b, kv), device, iters)
            results.append(
                Result(
                    f"decode pass, batch {n}, qwen3-0.6b bf16",
                    None,
                    f"modules' ops {modules_ms:.3f} ms, fused {eager_ms:.3f} ms, cuda graph "
                    f"{graph_ms:.3f} ms ({eager_ms / graph_ms:.1f}x faster than fused eager)",
                )
            )
    return results


def median_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3 if device.type == "cuda" else 1):  # warm-up, and the Triton compile
        fn()
    sync()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def run_engine_benchmark(timeout: float, extra_args: list[str]) -> Result:
    script = HERE / "bench_generate.py"
    name = "engine benchmark (bench_generate.py)"
    if not script.exists():
        return Result(name, None, "not run: benchmarks/bench_generate.py does not exist")
    cmd = [
        sys.executable,
        str(script),
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--config",
        "qwen3-0.6b",
        *extra_args,
    ]
    print(f"\n== {' '.join(cmd[1:])} ==", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            timeout=timeout,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        print(out if isinstance(out, str) else out.decode(errors="replace"))
        return Result(name, False, f"timed out after {timeout:.0f} s")
    print(proc.stdout, flush=True)
    elapsed = time.perf_counter() - start
    last = next((line for line in reversed(proc.stdout.splitlines()) if line.strip()), "")
    return Result(
        name,
        proc.returncode == 0,
        f"exit {proc.returncode} in {elapsed:.0f} s; last line: {last[:120]}",
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


if __name__ == "__main__":
    sys.exit(main())
