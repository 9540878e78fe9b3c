"""End-to-end generation throughput: tokentape's `LLM.generate` against vLLM's CPU engine and
Hugging Face transformers, on the same weights and the same prompts, in the same run.

Workloads (random token ids, seeded, greedy, ignore_eos, so every engine does the same work):
- `tiny` (default): N prompts (default 256), 32 to 256 tokens long, each asking for 64 to 256
  output tokens;
- `qwen3-0.6b` (Qwen3-0.6B's shapes, float32, seeded weights): N prompts (default 64) of 128
  tokens, 128 output tokens each.

Variants, each run once per round (`--repeats N` rounds, interleaved so that machine drift
falls on all alike, tokentape's starting one variant later each round; the best and the
median of each are reported):
- tokentape through the public API at its defaults, `LLM(model=..., tape=PATH, seed=...)`,
  with an SQLite tape (the figure compared): the KV cache sized from its memory budget,
  max_model_len the model's context length, the CPU's scheduling mode (sync); the same
  without a tape; the same in the other scheduling mode (async depth 2 on the CPU); and,
  labelled hand-tuned, a KV pool and max_model_len sized to the workload by this script. A
  fresh `LLM` each time, a warm-up `generate` of two prompts first; KV slots and preemptions
  are reported per variant;
- vLLM's CPU engine (benchmarks/baselines/vllm_generate.py, in vLLM's own Python): the
  built-in model written as a Hugging Face folder (`save_checkpoint`), prompts as token ids,
  every setting at vLLM's default (one `LLM` for every round, warmed up);
- transformers (benchmarks/baselines/hf_generate.py, its own process, so it runs on torch's
  default thread count whatever tokentape does): the same folder, batches sorted by output
  length, the best of `--hf-batch-sizes` (all of them in the first round, the best one after).

Beside wall time, the CPU time of every process over the same `generate`: tokentape's own
(all threads) and its tape writer's; vLLM's front end, engine core and worker; transformers'.
And the peak RSS of each engine, the highest of its rounds: tokentape's process from the
`LLM`'s construction to its close (the kernel's peak reset before it, so the model's load
counts and an earlier variant does not), its tape writer's added; vLLM's processes' peaks
since they started, summed. With `--fresh-vllm` (the default on qwen3-0.6b and on prompts of
2,048 tokens or more, where both engines resident do not fit in 24 GiB) vLLM starts afresh
for each of its rounds and is closed before tokentape's run: it holds nothing meanwhile, and
its start is not timed. The CPU model and tokentape's matmul backend are printed first.
Checks printed every run: the tokentape variants agree, and how many greedy streams equal
vLLM's and transformers' token for token.

Targets (tokentape at its defaults, the tape on): tiny >= 2.0x vLLM CPU's output tok/s;
qwen3-0.6b >= 2.0x, and >= 65% of the float32 matmul peak (about 90% of the highest share
the machine allows, below; its weight
GEMMs' FLOPs over the run's wall time, against the fastest of torch.mm, MKL's packed GEMM
and oneDNN's linear at the same shapes and threads: benchmarks/_matmul_peak.py, which also
measures the highest share any run could reach on the machine: the GEMMs alone, replayed,
plus the decodes' K/V at its read rate); prompts of
2,048 tokens or more (--prompt-len), on either model, >= 1.5x; tape on / off >= 0.98.
Without vLLM or transformers the script says so and leaves that column out. On CUDA it also
times the decode step at batch 1 and 64 against the memory-bandwidth floor (weight bytes /
4.8 TB/s, an H200's HBM3e).

    python benchmarks/bench_generate.py --repeats 2            # tiny, 256 prompts, CPU
    python benchmarks/bench_generate.py --config qwen3-0.6b --repeats 2
    python benchmarks/bench_generate.py --num-prompts 16       # a quick look
    python benchmarks/bench_generate.py --num-prompts 16 --prompt-len 2048 --output-len 128
    python benchmarks/bench_generate.py --device cuda --dtype bfloat16 --config qwen3-0.6b \
        --skip-vllm
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import _common as c
import _generate_baselines as gb
import _matmul_peak
import torch
from baselines import procstat
from baselines.client import SideError
from baselines.locate import find_transformers, find_vllm

from tokentape import LLM, SamplingParams
from tokentape.engine.model.decoder import CausalLM
from tokentape.engine.model.loader import builtin_model, save_checkpoint
from tokentape.engine.model.model_config import BUILTIN_CONFIGS
from tokentape.engine.runners.worker import on_a_thread_of_its_own

HBM_BYTES_PER_S = 4.8e12
TARGETS = {"tiny": 2.0, "qwen3-0.6b": 2.0}  # tokentape / vLLM CPU, output tok/s
# Share of the float32 matmul peak on the default prompts (qwen3-0.6b): their passes attend
# between their GEMMs, so about 70% is what 2 cores allow (the ceiling printed beside it).
PEAK_SHARE_TARGET = 0.65
# Long prompts (16 x 2,048 -> 128, a workload vLLM is built for), on either model.
LONG_PROMPT_LEN, LONG_PROMPT_TARGET = 2048, 1.5
DEFAULT_PROMPTS = {"tiny": 256, "qwen3-0.6b": 64}


def other_mode(device: str) -> tuple[str, dict[str, Any]]:
    """The scheduling mode the engine does not default to on `device` (config.resolve_config:
    sync for a model on the CPU, async depth 2 on CUDA), as a variant."""
    if device == "cpu":
        return "async (depth 2)", {"async_scheduling": True, "pipeline_depth": 2}
    return "sync", {"async_scheduling": False}


MAIN = "tokentape at its defaults, SQLite tape"
HAND_TUNED = "tokentape hand-tuned (KV pool and max_model_len sized to the workload), SQLite tape"


def tt_variants(device: str, defaults_only: bool = False) -> dict[str, dict[str, Any]]:
    if defaults_only:
        return {MAIN: {}}
    other, other_args = other_mode(device)
    return {
        MAIN: {},
        "tokentape at its defaults, no tape": {"tape": False},
        f"tokentape {other}, SQLite tape": other_args,
        HAND_TUNED: {"hand_tuned": True},
    }


def workload(
    config: str,
    n: int,
    vocab: int,
    seed: int,
    prompt_len: int | None = None,
    output_len: int | None = None,
) -> tuple[list[list[int]], list[int]]:
    """The prompts and output lengths (`prompt_len` / `output_len` fix either for every
    request: 16 x 2,048 -> 128 is the long-prompt workload)."""
    rng = random.Random(seed)
    qwen = config == "qwen3-0.6b"
    prompts, outputs = [], []
    for _ in range(n):
        length = prompt_len or (128 if qwen else rng.randint(32, 256))
        prompts.append([rng.randrange(3, vocab) for _ in range(length)])
        outputs.append(output_len or (128 if qwen else rng.randint(64, 256)))
    return prompts, outputs


def sync_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_tokentape(
    args: argparse.Namespace,
    prompts: list[list[int]],
    outputs: list[int],
    tmp: c.TempDir,
    variant: dict[str, Any],
) -> dict[str, Any]:
    engine_args = dict(variant)
    tape = engine_args.pop("tape", True)
    if engine_args.pop("hand_tuned", False):
        max_len = max(len(p) + o for p, o in zip(prompts, outputs))
        blocks = sum(-(-(len(p) + o) // 16) for p, o in zip(prompts, outputs)) + len(prompts)
        engine_args.update(num_kv_blocks=blocks, block_size=16, max_model_len=max_len + 1)
    # Only what the command line changed from the defaults is passed.
    if args.device != "cpu":
        engine_args["device"] = args.device
    if args.dtype != "float32":
        engine_args["dtype"] = args.dtype
    if args.max_num_batched_tokens is not None:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.cpu_threads is not None:
        engine_args["cpu_threads"] = args.cpu_threads
    path = tmp.new("bench") if tape else False
    reset = procstat.reset_peak_rss(os.getpid())  # this variant's peak, its model's load included
    llm = LLM(model=args.config, tape=path, seed=args.seed, **engine_args)
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outputs]
    llm.generate(prompts[:2], params[:2])  # warm-up
    writer = getattr(llm.llm_engine.engine_core.tape, "writer_pid", None)
    sync_device(args.device)
    w0 = procstat.cpu_seconds(writer) if writer else 0.0
    c0, t = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params)
    sync_device(args.device)
    elapsed, cpu = time.perf_counter() - t, time.process_time() - c0
    helpers = {"tape writer": procstat.cpu_seconds(writer) - w0} if writer else {}
    preemptions = sum(r.num_preemptions for r in llm.llm_engine.engine_core.state.requests.values())
    kv_tokens = llm.config.kv_capacity
    peak_rss = procstat.peak_rss_bytes(os.getpid()) if reset else None
    if writer:
        peak_rss = (peak_rss or 0) + procstat.peak_rss_bytes(writer)
    llm.close()
    if isinstance(path, str):
        c.remove_db(path)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(outputs), "every request must produce its requested tokens"
    return {
        "seconds": elapsed,
        "output_tokens": n_out,
        "cpu_main_s": cpu,
        "cpu_helpers_s": helpers,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "preemptions": preemptions,
        "kv_tokens": kv_tokens,
        "peak_rss": peak_rss,
    }


def from_side(reply: dict[str, Any], main: str) -> dict[str, Any]:
    cpu = dict(reply["cpu_s"])
    return {
        "seconds": reply["seconds"],
        "output_tokens": reply["output_tokens"],
        "cpu_main_s": cpu.pop(main),
        "cpu_helpers_s": cpu,
        "tokens": reply["tokens"],
    }


def decode_step_time(args: argparse.Namespace, batch: int, enforce_eager: bool = False) -> float:
    """Seconds per decode step with `batch` sequences (32-token prompts, 128 outputs each)."""
    llm = LLM(
        model=args.config,
        tape=False,
        device=args.device,
        dtype=args.dtype,
        enforce_eager=enforce_eager,
        pipeline_depth=2,
        num_kv_blocks=max(64, batch * 14),
        block_size=16,
        max_num_seqs=max(batch, 1),
        seed=args.seed,
    )
    rng = random.Random(1)
    vocab = BUILTIN_CONFIGS[args.config].vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(
            f"d{i}", p, SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
        )
    for _ in range(4):  # prefill and the first decodes, untimed
        engine.step()
    sync_device(args.device)
    steps, t = 128, time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync_device(args.device)
    elapsed = (time.perf_counter() - t) / steps
    llm.close()
    return elapsed


def variant_ratios(device: str, results: dict[str, Any]) -> list[dict[str, Any]]:
    """tokentape at its defaults against its other variants (those that ran)."""
    tt = results[MAIN]
    other_name = other_mode(device)[0]
    default_mode = "sync" if device == "cpu" else "async (depth 2)"
    # (figure, the variant divided by, target as text, its threshold on the best ratio)
    figures = [
        ("tape on / off", "tokentape at its defaults, no tape", ">= 0.98", 0.98),
        ("defaults / hand-tuned KV pool", HAND_TUNED, "-", None),
        (
            f"{default_mode} (the default) / {other_name}",
            f"tokentape {other_name}, SQLite tape",
            "-",
            None,
        ),
    ]
    out = []
    for figure, variant, target, threshold in figures:
        base = results.get(variant)
        if base is None:
            continue
        best, median = tt["tok_s"] / base["tok_s"], tt["median_tok_s"] / base["median_tok_s"]
        out.append(
            {
                "name": f"(g) {figure}, output tok/s",
                "value": f"{best:.3f} best; {median:.3f} by the medians",
                "target": target,
                "pass": None if threshold is None else best >= threshold,
            }
        )
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--config", choices=sorted(BUILTIN_CONFIGS), default="tiny")
    p.add_argument("--num-prompts", type=int, help="default: 256 for tiny, 64 for qwen3-0.6b")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokentape's (default: the engine's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds, each running every variant once; the best of each is kept",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="tokentape's cpu_threads (default: its own choice)",
    )
    p.add_argument("--vllm-python", metavar="PATH", help="the Python that has vllm")
    p.add_argument(
        "--vllm-kv-gib",
        type=int,
        help="VLLM_CPU_KVCACHE_SPACE (default: enough for every request, >= 2)",
    )
    p.add_argument(
        "--hf-batch-sizes",
        default="16,32,64,128",
        help="transformers' batch sizes to try (comma-separated)",
    )
    p.add_argument(
        "--hf-threads",
        type=int,
        help="transformers' torch thread count (default: torch's, one per core)",
    )
    p.add_argument("--prompt-len", type=int, help="every prompt this long (default: the config's)")
    p.add_argument("--output-len", type=int, help="every request this many tokens out")
    p.add_argument(
        "--fresh-vllm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start vLLM afresh for each of its rounds and close it after, so that it holds no "
        "memory while tokentape runs (default: on for qwen3-0.6b and for prompts of 2,048 "
        "tokens or more, where both engines resident do not fit in 24 GiB)",
    )
    p.add_argument("--skip-vllm", action="store_true", help="leave vLLM out")
    p.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    p.add_argument(
        "--defaults-only",
        action="store_true",
        help="tokentape at its defaults only, without its other variants (long runs)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    args.num_prompts = args.num_prompts or DEFAULT_PROMPTS.get(args.config, 256)
    if args.fresh_vllm is None:
        args.fresh_vllm = args.config != "tiny" or (args.prompt_len or 0) >= LONG_PROMPT_LEN
    return args


def main() -> int:
    args = parse_args()
    config = BUILTIN_CONFIGS[args.config]
    prompts, outputs = workload(
        args.config,
        args.num_prompts,
        config.vocab_size,
        args.seed,
        args.prompt_len,
        args.output_len,
    )
    n = len(prompts)
    print(
        f"# bench_generate: {n} prompts, config {args.config}, {args.device}, {args.dtype}; "
        f"{sum(map(len, prompts))} prompt tokens, {sum(outputs)} output tokens; "
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads in this process "
        f"at start",
        flush=True,
    )
    found_vllm, where = find_vllm(args.vllm_python)
    found_hf, where_hf = find_transformers(found_vllm)
    if args.skip_vllm:
        found_vllm, where = None, "vLLM: left out (--skip-vllm)"
    if args.skip_hf:
        found_hf, where_hf = None, "transformers: left out (--skip-hf)"
    print(f"# {where}\n# {where_hf}", flush=True)
    if args.device == "cpu":
        from tokentape.engine.model import cpu_matmul

        print(
            f"# CPU: {c.machine_info()['cpu']}; tokentape's float32 matmul: "
            f"{cpu_matmul.BACKEND.name} (of {', '.join(sorted(cpu_matmul.available()))})",
            flush=True,
        )

    load_before, ticks0 = os.getloadavg(), c.cpu_ticks()
    tmp = c.TempDir()
    sides: dict[str, gb.Side] = {}
    # Sides started afresh for each of their rounds (closed after them).
    starters: dict[str, Callable[[], gb.Side | None]] = {}
    failures: list[str] = []
    try:
        if found_vllm or found_hf:
            # On a thread of its own: the build's OpenMP team would stay on this thread beside
            # the engine's, and slow it (runners/worker.py), as a user's script does not.
            model_dir = on_a_thread_of_its_own(
                lambda: save_checkpoint(
                    builtin_model(args.config, args.seed)[1], tmp.new(args.config, "")
                )
            )
        max_len = max(len(p) + o for p, o in zip(prompts, outputs))
        if found_vllm:
            kv = args.vllm_kv_gib or gb.vllm_kv_cache_gib(
                config.to_hf_dict(),
                [len(p) + o for p, o in zip(prompts, outputs)],
                torch.finfo(getattr(torch, args.dtype)).bits // 8,
            )
            print(
                f"# starting vLLM (VLLM_CPU_KVCACHE_SPACE={kv}; its first start compiles "
                "for about a minute) ...",
                flush=True,
            )

            def start_vllm() -> gb.Side | None:
                """vLLM's side, started; None when it fails to (said, and not tried again)."""
                try:
                    side = gb.start_vllm(
                        found_vllm,
                        model_dir,
                        prompts,
                        outputs,
                        args.dtype,
                        args.seed,
                        max_len + 1,
                        kv,
                        tmp.path,
                    )
                except SideError as e:
                    failures.append(f"vLLM failed to start: {e}")
                    print(f"# {failures[-1]}", flush=True)
                    starters.pop("vllm", None)
                    return None
                print(f"# vLLM side: {side.info}", flush=True)
                return side

            if args.fresh_vllm:
                starters["vllm"] = start_vllm
            elif (side := start_vllm()) is not None:
                sides["vllm"] = side
        if found_hf:
            try:
                sides["hf"] = gb.start_hf(
                    found_hf, model_dir, prompts, outputs, args.dtype, args.hf_threads, tmp.path
                )
                print(f"# transformers side: {sides['hf'].info}", flush=True)
            except SideError as e:
                failures.append(f"transformers failed to start: {e}")
                print(f"# {failures[-1]}", flush=True)
        results, hf_by_size = run_rounds(args, prompts, outputs, tmp, sides, failures, starters)
    finally:
        for side in sides.values():
            side.close()
        tmp.cleanup()
    busy = c.busy_cores(ticks0, c.cpu_ticks())
    machine = (
        f"machine: load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} "
        f"after; {'?' if busy is None else f'{busy:.2f}'} of {os.cpu_count()} cores busy "
        "on average over the run, everything included"
    )
    peak, ceiling = None, None
    # After the rounds, so that it measures the machine as they found it; on qwen3-0.6b only:
    # tiny's GEMMs are so small that torch.mm's call overhead is most of its time.
    if args.device == "cpu" and args.config == "qwen3-0.6b":
        from tokentape.engine.config import EngineConfig
        from tokentape.engine.runners.devices import cpus_available

        prefill_rows = min(EngineConfig().max_num_batched_tokens, sum(map(len, prompts)))
        threads = args.cpu_threads or cpus_available()
        peak = _matmul_peak.peak_figure(config, prompts, outputs, prefill_rows, threads)
        ceiling = _matmul_peak.ceiling_figure(config, prompts, outputs, prefill_rows, threads)
    return report(
        args, prompts, outputs, results, hf_by_size, sides, failures, machine, peak, ceiling
    )


def run_rounds(
    args: argparse.Namespace,
    prompts: list[list[int]],
    outputs: list[int],
    tmp: c.TempDir,
    sides: dict[str, gb.Side],
    failures: list[str],
    starters: dict[str, Callable[[], gb.Side | None]] | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[int, float]]:
    """`args.repeats` rounds of every variant; the best (shortest) run of each is kept."""
    results: dict[str, dict[str, Any]] = {}
    hf_by_size: dict[int, float] = {}  # transformers' best seconds per batch size

    all_seconds: dict[str, list[float]] = {}
    all_peaks: dict[str, list[int]] = {}

    def keep(name: str, r: dict[str, Any]) -> None:
        r["tok_s"] = r["output_tokens"] / r["seconds"]
        all_seconds.setdefault(name, []).append(r["seconds"])
        if name not in results or r["seconds"] < results[name]["seconds"]:
            results[name] = r  # with its own tokens: a batch size may change transformers' bits
        best = results[name]
        best["median_tok_s"] = best["output_tokens"] / statistics.median(all_seconds[name])
        peaks = all_peaks.setdefault(name, [])
        if r.get("peak_rss"):
            peaks.append(r["peak_rss"])
        best["max_peak_rss"] = max(peaks, default=None)

    sizes = gb.hf_batch_sizes([int(s) for s in args.hf_batch_sizes.split(",")], len(prompts))
    variants = list(tt_variants(args.device, args.defaults_only).items())
    for rnd in range(args.repeats):
        # Each round starts one variant later, as ab_defaults.py's do: in a fixed order the
        # defaults, always first after the baselines' round, came out 0.75x of the same engine
        # without a tape, where fresh processes in turn measure 1.00x (docs/benchmarks.md).
        shift = rnd % len(variants)
        for name, variant in variants[shift:] + variants[:shift]:
            for side in sides.values():
                side.idle_begin()
            r = run_tokentape(args, prompts, outputs, tmp, variant)
            keep(name, r)
            for side in sides.values():
                side.idle_end()
            print(f"# round {rnd + 1}: {name} {r['seconds']:.2f} s", flush=True)
        start = (starters or {}).get("vllm")
        if start is not None and (side := start()) is not None:
            sides["vllm"] = side  # for this round, closed after it: it holds nothing meanwhile
        if "vllm" in sides:
            try:
                reply = sides["vllm"].proc.call("round", tokens=True)
                r = from_side(reply, "front end")
                # Its processes' peaks since they started: the model's load included.
                r["peak_rss"] = procstat.tree_peak_rss_bytes(sides["vllm"].proc.pid)
                keep("vLLM CPU engine", r)
                sides["vllm"].settle()
                print(f"# round {rnd + 1}: vLLM {reply['seconds']:.2f} s", flush=True)
            except SideError as e:
                failures.append(f"vLLM failed: {e}")
                print(f"# {failures[-1]}", flush=True)
                sides.pop("vllm").close()
                (starters or {}).pop("vllm", None)  # not started again
        if start is not None and "vllm" in sides:
            sides.pop("vllm").close()
        if "hf" in sides:
            todo = sizes if rnd == 0 else [min(hf_by_size, key=hf_by_size.__getitem__)]
            try:
                for size in todo:
                    reply = sides["hf"].proc.call("round", batch_size=size, tokens=True)
                    sides["hf"].settle()
                    r = from_side(reply, "transformers")
                    r["batch_size"] = size
                    hf_by_size[size] = min(hf_by_size.get(size, float("inf")), r["seconds"])
                    keep("transformers", r)
                    print(
                        f"# round {rnd + 1}: transformers, batch {size}: {r['seconds']:.2f} s",
                        flush=True,
                    )
            except SideError as e:
                failures.append(f"transformers failed: {e}")
                print(f"# {failures[-1]}", flush=True)
                sides.pop("hf").close()
    return results, hf_by_size


def same_streams(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(list(x) == list(y) for x, y in zip(a, b))


def streams_compared(a: list[list[int]], b: list[list[int]], other: str) -> str:
    """How many greedy streams equal `other`'s, and where the others part: late partings are
    rounding (a near tie between two logits flipped), a parting at the first token is a bug."""
    equal = same_streams(a, b)
    line = f"greedy streams equal to {other}: {equal}/{len(a)}"
    parted = sorted(
        next(i for i, (x, y) in enumerate(zip([*s, None], [*t, None])) if x != y)
        for s, t in zip(a, b)
        if list(s) != list(t)
    )
    if parted:
        line += (
            f"; the others part at token {parted[len(parted) // 2]} at the median, "
            f"{parted[0]} at the earliest"
        )
    return line


def report(
    args: argparse.Namespace,
    prompts: list[list[int]],
    outputs: list[int],
    results: dict[str, dict[str, Any]],
    hf_by_size: dict[int, float],
    sides: dict[str, gb.Side],
    failures: list[str],
    machine: str,
    peak: _matmul_peak.PeakFigure | None = None,
    ceiling: _matmul_peak.CeilingFigure | None = None,
) -> int:
    n = len(prompts)
    rows = []
    for name, r in results.items():
        helpers = r["cpu_helpers_s"]
        label = name if name != "transformers" else f"transformers (batch {r['batch_size']})"
        kv = f"{r['kv_tokens']:,} slots, {r['preemptions']} preempted" if "kv_tokens" in r else "-"
        rss = r.get("max_peak_rss")
        rows.append(
            [
                label,
                f"{r['seconds']:.2f}",
                _rate(r["tok_s"]),
                _rate(r["median_tok_s"]),
                kv,
                f"{rss / 2**30:.2f}" if rss else "-",
                f"{r['cpu_main_s']:.2f}",
                f"{sum(helpers.values()):.2f}",
                ", ".join(f"{k} {v:.2f}" for k, v in helpers.items() if v >= 0.005) or "-",
            ]
        )
    headers = [
        "variant",
        "wall (s)",
        "output tok/s",
        "median tok/s",
        "KV cache",
        "peak RSS (GiB)",
        "CPU, main process (s)",
        "CPU, helper processes (s)",
        "helpers",
    ]
    lines = [
        f"### (g) Generation throughput: {n} prompts, {args.config}, {args.device}, "
        f"{args.dtype}; {sum(outputs):,} output tokens (best of {args.repeats} "
        "interleaved rounds)",
        "",
        c.md_table(headers, rows),
        "",
    ]
    if hf_by_size:
        lines.append(
            "transformers by batch size (best seconds): "
            + ", ".join(f"{s}: {t:.2f}" for s, t in sorted(hf_by_size.items()))
        )
    for side in sides.values():
        if side.idle_wall_s:
            owner = side.name + ("'" if side.name.endswith("s") else "'s")
            lines.append(
                f"{owner} processes while the tokentape variants ran: "
                f"{side.idle_cpu_s:.2f} CPU s in {side.idle_wall_s:.1f} s"
            )
    lines.append(machine)
    tt = results[MAIN]
    agree = all(
        same_streams(tt["tokens"], results[v]["tokens"]) == n
        for v in tt_variants(args.device, args.defaults_only)
    )
    lines.append(f"tokentape variants agree: {'yes' if agree else 'NO'}")
    summary: list[dict[str, Any]] = []
    long_prompts = (args.prompt_len or 0) >= LONG_PROMPT_LEN
    target = LONG_PROMPT_TARGET if long_prompts else TARGETS.get(args.config)
    if "vLLM CPU engine" in results:
        v = results["vLLM CPU engine"]
        equal = same_streams(tt["tokens"], v["tokens"])
        lines.append(streams_compared(tt["tokens"], v["tokens"], "vLLM"))
        ratio = tt["tok_s"] / v["tok_s"]
        median_ratio = tt["median_tok_s"] / v["median_tok_s"]
        summary.append(
            {
                "name": f"(g) tokentape / vLLM CPU, output tok/s ({args.config}, "
                f"{n} prompts, tape on)",
                "value": (
                    f"{ratio:.3f}x best ({_rate(tt['tok_s'])} vs {_rate(v['tok_s'])} tok/s); "
                    f"{median_ratio:.3f}x by the medians"
                ),
                "target": f">= {target:.1f}x" if target else "-",
                "pass": (ratio >= target) if target else None,
            }
        )
        summary.append(
            {
                "name": "(g) greedy streams equal to vLLM's",
                "value": f"{equal}/{n}",
                "target": f"{n}/{n}",
                "pass": equal == n,
            }
        )
        if tt.get("max_peak_rss") and v.get("max_peak_rss"):
            ours, theirs = tt["max_peak_rss"], v["max_peak_rss"]
            summary.append(
                {
                    "name": "(g) peak RSS, tokentape's process (its tape writer's added) against "
                    "vLLM's processes' peaks summed, the highest of the rounds",
                    "value": f"{ours / 2**30:.2f} GiB vs {theirs / 2**30:.2f} GiB "
                    f"({ours / theirs:.2f}x)",
                    "target": "<= 1.00x",
                    "pass": ours <= theirs,
                }
            )
    else:
        lines.append("greedy streams equal to vLLM: not measured (no vLLM)")
        summary.append(
            {
                "name": f"(g) tokentape / vLLM CPU ({args.config})",
                "value": "not measured: no vLLM",
                "target": f">= {target:.1f}x" if target else "-",
                "pass": None,
            }
        )
    if "transformers" in results:
        h = results["transformers"]
        lines.append(streams_compared(tt["tokens"], h["tokens"], "transformers"))
        summary.append(
            {
                "name": "(g) tokentape / transformers at its best, output tok/s",
                "value": f"{tt['tok_s'] / h['tok_s']:.3f}x ({_rate(tt['tok_s'])} vs "
                f"{_rate(h['tok_s'])} tok/s, batch {h['batch_size']})",
                "target": "-",
                "pass": None,
            }
        )
    else:
        lines.append("greedy streams equal to transformers: not measured (no transformers)")
    if peak is not None:
        share = peak.fraction(tt["seconds"])
        lines.append(f"matmul peak: tokentape at its defaults, {peak.describe(tt['seconds'])}")
        summary.append(
            {
                "name": "(g) tokentape at its defaults, share of the float32 matmul peak",
                "value": f"{100 * share:.1f}%",
                # The target is on the default prompts; over long ones attention, which is
                # no weight GEMM, is much of the work.
                "target": "-" if long_prompts else f">= {100 * PEAK_SHARE_TARGET:.0f}%",
                "pass": None if long_prompts else share >= PEAK_SHARE_TARGET,
            }
        )
    if peak is not None and ceiling is not None:
        lines.append(f"matmul peak, what this machine allows: {ceiling.describe(peak)}")
        summary.append(
            {
                "name": "(g) the highest share of the peak any run could reach on this machine",
                "value": f"{100 * ceiling.share(peak):.1f}%",
                "target": "-",
                "pass": None,
            }
        )
    summary += variant_ratios(args.device, results)
    if args.device == "cuda":
        cuda_figures(args, summary)
    if target:
        lines.append(
            f"target: tokentape (its defaults, tape on) >= {target:.1f}x vLLM CPU's output "
            f"tok/s on {args.config}"
        )
    lines += [
        "",
        c.md_table(
            ["figure", "value", "target", "result"],
            [[s["name"], s["value"], s["target"], _verdict(s)] for s in summary],
        ),
    ]
    lines += [f"FAILED: {f}" for f in failures]
    markdown = "\n".join(lines)
    c.emit(
        {
            "bench": "generate",
            "config": args.config,
            "num_prompts": n,
            "results": {
                k: {kk: vv for kk, vv in r.items() if kk != "tokens"} for k, r in results.items()
            },
            "hf_by_batch_size": hf_by_size,
            "sides": {k: s.info for k, s in sides.items()},
            "summary": summary,
            "failures": failures,
        },
        "\n" + markdown,
        args.json,
    )
    return 1 if failures or not agree else 0


def _rate(x: float) -> str:
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def _verdict(figure: dict[str, Any]) -> str:
    if figure["pass"] is None:
        return "-" if figure["target"] == "-" else "not measured"
    return c.verdict(figure["pass"])


def cuda_figures(args: argparse.Namespace, summary: list[dict[str, Any]]) -> None:
    with torch.device("meta"):  # shapes only
        model = CausalLM(BUILTIN_CONFIGS[args.config])
    weight_bytes = (
        sum(t.numel() for t in model.parameters())
        * torch.finfo(getattr(torch, args.dtype)).bits
        // 8
    )
    floor = weight_bytes / HBM_BYTES_PER_S
    for batch in (1, 64):
        step = decode_step_time(args, batch)
        eager = decode_step_time(args, batch, enforce_eager=True)
        summary.append(
            {
                "name": f"decode step, batch {batch} (CUDA)",
                "value": f"{step * 1e3:.3f} ms ({step / floor:.2f}x the floor, "
                f"{floor * 1e3:.3f} ms); enforce_eager {eager * 1e3:.3f} ms",
                "target": "-",
                "pass": None,
            }
        )


if __name__ == "__main__":
    sys.exit(main())
