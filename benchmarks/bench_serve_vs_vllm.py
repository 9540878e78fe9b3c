"""Serving side by side: `tokentape serve --model DIR` against `vllm serve DIR` on the same
checkpoint folder, both driven by vLLM's own load generator, `vllm bench serve`, in one run.

The checkpoint: a built-in model (`--model tiny`, the default, or `qwen3-0.6b`; weights drawn
from `--seed`) written as a Hugging Face folder (`save_checkpoint`: config.json and
model.safetensors) with the byte tokenizer beside it (`_common.write_tokenizer`:
tokenizer.json and a tokenizer_config.json that vLLM's tokenizer loader reads as the same
byte tokenizer), or `--model DIR`, a folder of your own with its tokenizer. Both servers and
the client load that folder; nothing is downloaded (HF_HUB_OFFLINE=1). Both run float32 on
the CPU.

Load (issue 42): `vllm bench serve --backend openai --endpoint /v1/completions
--dataset-name random --random-input-len 256 --random-output-len 128 --ignore-eos
--num-prompts 200 --seed 0 --max-concurrency C`, for C in 1, 16 and 64 (`--concurrency`), run
as its CLI runs it, in vLLM's Python (baselines/vllm_serve.py says why not through the
venv's `vllm` script). vLLM is found as the other benchmarks find it: `--vllm-python`,
$TOKENTAPE_VLLM_PYTHON, or .venv-vllm in the repository root.

Rounds (`--rounds`, default 3): in each, every concurrency, and at each both engines, one
after the other; the engines' order flips every round, so a drift of the machine falls on
both alike. Every run gets a fresh server: the dataset's seed makes every run's prompts the
same, and both engines cache prefixes by default, so a server that had served them would
answer the next run's prefills from its cache. A server's start is not timed; it answers one
short warm-up request (a text the dataset does not hold) before the client starts.

tokentape: `tokentape serve --model DIR --tape-dir DIR` at its defaults, with its flight
recorder on at the default retention (1GB, 60 s segments): the model on one lane per CPU
(as `generate` runs it; the HTTP server shares the CPUs), sync scheduling, vLLM's server
step budget on the CPU (2,048 tokens, 128 sequences, as vLLM's below), prefix caching, a
KV cache sized from memory (4 GiB, or a quarter of the RAM if that is less; this script sets no
VLLM_CPU_KVCACHE_SPACE for it, which it would read). `--tokentape-args` adds options.

vLLM: `vllm serve DIR --dtype float32 --seed S` at its defaults (for its server on the CPU:
sync scheduling, block size 128, prefix caching, chunked prefill, max_num_seqs 128,
max_num_batched_tokens 2,048; its offline LLM's are 256 and 4,096), with the settings its CPU
users give it, as bench_generate.py gives them:
- VLLM_CPU_KVCACHE_SPACE (`--vllm-kv-gib`): on the CPU, vLLM takes its KV cache's size from
  this variable (without it, a share of the whole RAM). Sized as bench_generate sizes it
  (_generate_baselines.vllm_kv_cache_gib): every request of the largest concurrency at once,
  +15%, at least 2 GiB, so vLLM never preempts for want of KV. `--max-model-len` is given
  only where that cache cannot hold one request of the model's full context (qwen3-0.6b):
  the workload's longest request, rounded up to vLLM's CPU block of 128.
- Threads: VLLM_CPU_OMP_THREADS_BIND left at vLLM's `auto`. On x86 that is one OpenMP thread
  per physical core with one core kept back (VLLM_CPU_NUM_OF_RESERVED_CPU's default) for the
  API server and the engine core: on 2 vCPUs, the model on one core and the serving
  processes on the other (tokentape serve's lanes use both cores). Binding the model's
  threads to every core (VLLM_CPU_OMP_THREADS_BIND=0-1) puts them on the core the API server
  and engine core run on; try it with `--vllm-env`. vLLM's docs also suggest LD_PRELOAD of
  tcmalloc and Intel's OpenMP; bench_generate's vLLM runs without them, and so does this
  script unless `--vllm-env LD_PRELOAD=...` adds them.
`--vllm-env KEY=VALUE` and `--vllm-args` add to or override any of these.

Reported for each engine at each concurrency: output tok/s (vLLM's `output_throughput`:
output tokens over the client's wall time; best and median of the rounds), TTFT and TPOT
(the client's median and p99 in each run; the median of those over the rounds), and the CPU
microseconds per output token of each helper process over the client's run (CPU clocks by
pid): tokentape's server, engine core and tape writers (bench_serve.Server: the writers
below the core, and the ones it reaped as segments closed); vLLM's API server, engine core,
its worker (the model) and the rest (multiprocessing's resource tracker). Then the ratios
tokentape / vLLM, and issue 42's goals: output tok/s at least 1.5x vLLM's at concurrency 16
and up, by the best rounds and by the medians; median TTFT and TPOT no higher than vLLM's at
every concurrency. The load average is printed at the start and the end (and kept per run in
the JSON), and the CPU model.

    python benchmarks/bench_serve_vs_vllm.py                    # 200 prompts, 1/16/64, 3 rounds
    python benchmarks/bench_serve_vs_vllm.py --json results.json    # the table, and the JSON
    python benchmarks/bench_serve_vs_vllm.py --num-prompts 16 --concurrency 1,4 --rounds 1
    python benchmarks/bench_serve_vs_vllm.py --vllm-env VLLM_CPU_OMP_THREADS_BIND=0-1
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, md_table, write_tokenizer  # noqa: E402
from _generate_baselines import GIB, VLLM_BLOCK, vllm_kv_cache_gib  # noqa: E402
from baselines.locate import find_vllm  # noqa: E402
from baselines.vllm_serve import VLLMServer, run_bench_serve, summarize_rounds  # noqa: E402
from bench_serve import Server  # noqa: E402

from tokentape.engine.model.model_config import BUILTIN_CONFIGS  # noqa: E402

ENGINES = ("tokentape", "vLLM")
GOAL_TOK_S = 1.5  # tokentape / vLLM output tok/s, at concurrency GOAL_FROM and up
GOAL_FROM = 16
FLOAT32_BYTES = 4


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def prepare_checkpoint(model: str, seed: int, tmp: str) -> tuple[str, dict[str, Any], str]:
    """(the folder both servers load, its config.json, how it was made)."""
    if model in BUILTIN_CONFIGS:
        from tokentape.engine.model.loader import builtin_model, save_checkpoint

        folder = save_checkpoint(builtin_model(model, seed)[1], os.path.join(tmp, model))
        write_tokenizer(folder, BUILTIN_CONFIGS[model])
        how = f"{model} (built in, weights from seed {seed}), written as a Hugging Face folder"
    else:
        folder = os.path.abspath(model)
        if not os.path.exists(os.path.join(folder, "tokenizer.json")):
            raise SystemExit(f"{folder}: no tokenizer.json; the random dataset needs one")
        how = f"the folder {model}"
    with open(os.path.join(folder, "config.json")) as f:
        return folder, json.load(f), how


def kv_bytes_per_token(hf: dict[str, Any]) -> int:
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    return hf["num_hidden_layers"] * 2 * kv_heads * head_dim * FLOAT32_BYTES


def vllm_settings(
    args: argparse.Namespace, hf: dict[str, Any]
) -> tuple[dict[str, str], list[str], int]:
    """vLLM's environment, its `vllm serve` options and its KV cache in GiB (see the doc)."""
    request = args.input_len + args.output_len
    kv = args.vllm_kv_gib or vllm_kv_cache_gib(hf, [request] * max(args.concurrency), FLOAT32_BYTES)
    serve = ["--dtype", "float32", "--seed", str(args.seed)]
    if kv_bytes_per_token(hf) * hf["max_position_embeddings"] > kv * GIB:
        # The client's re-encoding of a prompt may add a token or two: 16 tokens to spare.
        longest = -(-(request + 16) // VLLM_BLOCK) * VLLM_BLOCK
        serve += ["--max-model-len", str(longest)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv)}
    for item in args.vllm_env:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--vllm-env {item!r}: expected KEY=VALUE")
        env[key] = value
    return env, serve + shlex.split(args.vllm_args), kv


def warm_up(url: str, model: str) -> None:
    """One short request, so that a fresh server's first-request costs fall outside the run;
    its text is not in the dataset (whose prompts are the vocabulary's tokens at random)."""
    body = json.dumps(
        {"model": model, "prompt": "warm-up", "max_tokens": 16, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as r:
        r.read()


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue  # deleted meanwhile
    return total


def run_one(
    engine: str,
    concurrency: int,
    run: str,
    args: argparse.Namespace,
    python: str,
    folder: str,
    vllm: tuple[dict[str, str], list[str]],
    tmp: str,
) -> dict[str, Any]:
    """A fresh server of `engine`, warmed up, under one `vllm bench serve` run; stopped."""
    load = loadavg()
    started = time.perf_counter()
    tape = os.path.join(tmp, f"{run}.tape")
    server: Server | VLLMServer
    if engine == "tokentape":
        server = Server(folder, ["--tape-dir", tape], shlex.split(args.tokentape_args))
    else:
        env, serve = vllm
        server = VLLMServer(python, folder, serve, env, os.path.join(tmp, f"{run}.log"))
    try:
        startup_s = time.perf_counter() - started
        warm_up(server.url, folder)
        before = server.cpu()
        result, client_cpu = run_bench_serve(
            python,
            server.url,
            folder,
            folder,
            os.path.join(tmp, f"{run}.json"),
            num_prompts=args.num_prompts,
            max_concurrency=concurrency,
            input_len=args.input_len,
            output_len=args.output_len,
            seed=args.seed,
            timeout=args.client_timeout,
        )
        after = server.cpu()
    except BaseException:
        if isinstance(server, VLLMServer):
            log(server.tail())
        raise
    finally:
        server.stop()
    tokens = result["total_output_tokens"]
    cpu = {k: after[k] - before[k] for k in after}
    out: dict[str, Any] = {
        "engine": engine,
        "concurrency": concurrency,
        "loadavg_at_start": load,
        "startup_s": round(startup_s, 1),
        "duration_s": round(result["duration"], 3),
        "output_tok_s": result["output_throughput"],
        "output_tokens": tokens,
        "input_tokens": result["total_input_tokens"],
        "median_ttft_ms": result["median_ttft_ms"],
        "p99_ttft_ms": result["p99_ttft_ms"],
        "median_tpot_ms": result["median_tpot_ms"],
        "p99_tpot_ms": result["p99_tpot_ms"],
        "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
        "cpu_us_per_token": {k: v / tokens * 1e6 for k, v in cpu.items()},
        "client_cpu_s": round(client_cpu, 3),
    }
    if engine == "tokentape":
        out["tape_bytes"] = dir_bytes(tape)  # what the flight recorder kept
        shutil.rmtree(tape)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """summarize_rounds with the p99 latencies too, the servers' start-up and the tape's bytes
    per output token."""
    out = summarize_rounds(runs, ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"))
    out["startup_s"] = [r["startup_s"] for r in runs]
    out["output_tokens"] = [r["output_tokens"] for r in runs]
    if "tape_bytes" in runs[0]:
        out["tape_bytes_per_token"] = round(
            statistics.median(r["tape_bytes"] / r["output_tokens"] for r in runs), 1
        )
    return out


def compare(tt: dict[str, Any], vl: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """tokentape / vLLM for each figure, and issue 42's goals at this concurrency."""
    ratios = {
        "tok_s_best": tt["tok_s_best"] / vl["tok_s_best"],
        "tok_s_median": tt["tok_s_median"] / vl["tok_s_median"],
    }
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"):
        ratios[key] = tt[key] / vl[key] if vl[key] else float("nan")
    out: dict[str, Any] = {k: round(v, 3) for k, v in ratios.items()}
    if concurrency >= GOAL_FROM:
        out["goal_tok_s"] = min(ratios["tok_s_best"], ratios["tok_s_median"]) >= GOAL_TOK_S
    else:
        out["goal_tok_s"] = None  # the throughput goal is set at 16 and 64
    out["goal_latency"] = ratios["median_ttft_ms"] <= 1.0 and ratios["median_tpot_ms"] <= 1.0
    return out


def _cpu_text(cpu: dict[str, float]) -> str:
    parts = [f"{k.replace('_', ' ')} {v:,.0f}" for k, v in cpu.items() if k != "total"]
    return " + ".join(parts) + f" = {cpu['total']:,.0f}"


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("met" if ok else "NOT met")


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "## bench_serve_vs_vllm: tokentape serve against vllm serve, under vllm bench serve",
        "",
        f"- machine: {result['machine']['cpu']}; tokentape {result['machine']['tokentape']}",
        f"- load average (1, 5, 15 min): at start {result['loadavg_start']}, at end "
        f"{result['loadavg_end']}",
        f"- checkpoint: {result['checkpoint']}, float32",
        f"- client: {result['client']}",
        f"- load: {result['num_prompts']} prompts a run, random {result['input_len']} -> "
        f"{result['output_len']} tokens, ignore_eos, seed {result['seed']}; concurrency "
        f"{', '.join(map(str, result['concurrency']))}; {result['rounds']} round(s), engine "
        f"order {result['order']}; a fresh server a run",
        f"- tokentape: `{result['tokentape_command']}`",
        f"- vLLM: `{result['vllm_command']}`",
        "",
    ]
    rows = []
    for c in result["concurrency"]:
        for engine in ENGINES:
            s = result["engines"][engine][str(c)]
            rows.append(
                [
                    c,
                    engine,
                    f"{s['tok_s_best']:,.1f}",
                    f"{s['tok_s_median']:,.1f}",
                    f"{s['median_ttft_ms']:,.1f}",
                    f"{s['p99_ttft_ms']:,.1f}",
                    f"{s['median_tpot_ms']:.2f}",
                    f"{s['p99_tpot_ms']:.2f}",
                    _cpu_text(s["cpu_us_per_token"]),
                ]
            )
    lines.append(
        md_table(
            [
                "concurrency",
                "engine",
                "out tok/s best",
                "median",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "TPOT p50 ms",
                "TPOT p99 ms",
                "CPU µs per output token",
            ],
            rows,
        )
    )
    rows = []
    for c in result["concurrency"]:
        r = result["ratios"][str(c)]
        rows.append(
            [
                c,
                f"**{r['tok_s_best']:.3f}x**",
                f"{r['tok_s_median']:.3f}x",
                f"{r['median_ttft_ms']:.3f}",
                f"{r['p99_ttft_ms']:.3f}",
                f"{r['median_tpot_ms']:.3f}",
                f"{r['p99_tpot_ms']:.3f}",
                _verdict(r["goal_tok_s"]),
                _verdict(r["goal_latency"]),
            ]
        )
    lines += [
        "",
        "tokentape / vLLM (tok/s: higher is better; latencies: lower is better):",
        "",
        md_table(
            [
                "concurrency",
                "out tok/s best",
                "median",
                "TTFT p50",
                "TTFT p99",
                "TPOT p50",
                "TPOT p99",
                f"tok/s >= {GOAL_TOK_S}x (at {GOAL_FROM}+)",
                "p50 TTFT and TPOT <= vLLM's",
            ],
            rows,
        ),
        "",
        "The latencies are the medians over the rounds of each run's median and p99. CPU: each "
        "process's CPU over the client's run over the output tokens, the median of the rounds "
        "(tokentape: server, engine core, tape writers; vLLM: API server, engine core, worker, "
        "other).",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="tiny",
        help="a built-in model written as a folder (tiny, the default, or qwen3-0.6b), or a "
        "Hugging Face checkpoint folder with its tokenizer.json",
    )
    p.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 16, 64],
        help="the client's --max-concurrency values, comma-separated (default 1,16,64)",
    )
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="the dataset's and both engines' seed")
    p.add_argument("--rounds", type=int, default=3, help="every run once a round (default 3)")
    p.add_argument("--vllm-python", default=None, help="the Python that has vllm")
    p.add_argument(
        "--vllm-kv-gib",
        type=int,
        default=None,
        help="VLLM_CPU_KVCACHE_SPACE (default: every request of the largest concurrency at "
        "once, +15%%, at least 2)",
    )
    p.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more environment for vllm serve (repeatable), e.g. VLLM_CPU_OMP_THREADS_BIND=0-1",
    )
    p.add_argument("--vllm-args", default="", help="more `vllm serve` options, one string")
    p.add_argument("--tokentape-args", default="", help="more `tokentape serve` options")
    p.add_argument(
        "--client-timeout", type=float, default=3600.0, help="seconds a client run may take"
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write the results as JSON to PATH (and print the table), or with no PATH print "
        "the JSON instead of the table",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    found, where = find_vllm(args.vllm_python)
    if found is None:
        print(where, file=sys.stderr)
        return 2
    machine = machine_info()
    log(f"{machine['cpu']}; {where}")
    loadavg_start = loadavg()
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {
        e: {c: [] for c in args.concurrency} for e in ENGINES
    }
    orders = []
    with tempfile.TemporaryDirectory(prefix="bench-serve-vs-vllm-") as tmp:
        folder, hf, checkpoint = prepare_checkpoint(args.model, args.seed, tmp)
        env, serve, kv = vllm_settings(args, hf)
        log(f"checkpoint: {checkpoint}; vLLM: VLLM_CPU_KVCACHE_SPACE={kv}")
        for r in range(args.rounds):
            order = ENGINES if r % 2 == 0 else ENGINES[::-1]
            orders.append(",".join(order))
            for c in args.concurrency:
                for engine in order:
                    log(
                        f"round {r + 1}/{args.rounds}, concurrency {c}: {engine}, "
                        f"{args.num_prompts} prompts (load average {loadavg()})"
                    )
                    name = f"{engine}-c{c}-r{r}"
                    run = run_one(engine, c, name, args, found.python, folder, (env, serve), tmp)
                    log(
                        f"  {run['output_tok_s']:,.1f} tok/s in {run['duration_s']:.1f} s, "
                        f"TTFT p50 {run['median_ttft_ms']:.1f} ms, TPOT p50 "
                        f"{run['median_tpot_ms']:.2f} ms (server started in "
                        f"{run['startup_s']:.0f} s)"
                    )
                    runs[engine][c].append(run)
    summary = {e: {str(c): summarize(rs) for c, rs in by_c.items()} for e, by_c in runs.items()}
    ratios = {
        str(c): compare(summary["tokentape"][str(c)], summary["vLLM"][str(c)], c)
        for c in args.concurrency
    }
    env_text = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    result = {
        "bench": "serve_vs_vllm",
        "machine": machine,
        "loadavg_start": loadavg_start,
        "loadavg_end": loadavg(),
        "checkpoint": checkpoint,
        "client": f"vllm bench serve (vLLM {found.version}, {found.python})",
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "order": " / ".join(orders),
        "tokentape_command": shlex.join(
            ["tokentape", "serve", "--model", "DIR", "--tape-dir", "TAPE"]
            + shlex.split(args.tokentape_args)
        ),
        "vllm_command": f"{env_text} vllm serve DIR {shlex.join(serve)}",
        "vllm_kv_gib": kv,
        "engines": summary,
        "ratios": ratios,
        "runs": runs,
    }
    if args.json == "-":
        print(json.dumps(result))
        return 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
