"""Serving under load: `tokentape serve` (engine core in its own process, SQLite tape) with N
concurrent streaming clients, against in-process `LLM.generate` on the same workload, in the
same run.

Workload: N prompts (default 64) of seeded random token ids, 32 tokens each, each asking for
M output tokens (default 64), greedy and ignore_eos, so both sides do the same work. The
clients (httpx, one asyncio loop in this process) all start at once, stream with SSE, and
read `token_ids` from each chunk; every stream is checked against the `generate` run's.

Reported: p50 and p99 time to first token (send to the first chunk with a token) and
inter-token latency (the gap between consecutive chunks of a stream, per token), output
tokens/s of both (the best of `--repeats` rounds, alternating), and what serving costs:
1 - serve/generate. Target: serving costs at most 10% (on the real model; the oracle's
steps cost next to nothing, so there HTTP is the whole cost).

    python benchmarks/bench_serve.py                      # tiny, 64 clients x 64 tokens
    python benchmarks/bench_serve.py --num-clients 256 --max-tokens 32
    python benchmarks/bench_serve.py --model oracle       # the server's own overhead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

PROMPT_LEN = 32


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def workload(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(PROMPT_LEN)] for _ in range(n)]


def run_generate(model: str, prompts: list[list[int]], max_tokens: int, engine_args: list[str], tmp: str) -> tuple[float, list[list[int]]]:
    from tokentape import LLM, SamplingParams

    kwargs = _engine_kwargs(engine_args)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(model, tape=tempfile.mktemp(dir=tmp, suffix=".tape"), **kwargs) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    return wall, [o.outputs[0].token_ids for o in outs]


def _engine_kwargs(engine_args: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(0, len(engine_args), 2):
        out[engine_args[i].lstrip("-").replace("-", "_")] = int(engine_args[i + 1])
    return out


class Server:
    def __init__(self, model: str, tape: str, engine_args: list[str]) -> None:
        cmd = [sys.executable, "-m", "tokentape.entrypoints.serve", "--model", model, "--host", "127.0.0.1",
               "--port", "0", "--tape", tape, "--drain-timeout", "1", *engine_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                m = re.search(r"serving on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
                elif "tape:" not in line:
                    sys.stderr.write(line)

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300):
            self.stop()
            raise RuntimeError("the server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        self.proc.wait(120)


async def clients(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    import httpx

    ttft: list[float] = []
    itl: list[float] = []
    streams: list[list[int]] = [[] for _ in prompts]
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as http:
        warm = {"model": model, "prompt": prompts[0][:4], "max_tokens": 4, "temperature": 0}
        (await http.post("/v1/completions", json=warm)).raise_for_status()

        async def one(i: int) -> None:
            body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True}
            sent = time.perf_counter()
            last = None
            async with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    got = json.loads(line[6:])["choices"][0]["token_ids"]
                    if not got:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - sent)
                    else:
                        itl.extend([(now - last) / len(got)] * len(got))
                    last = now
                    streams[i] += got

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - start
    return {"wall": wall, "ttft": ttft, "itl": itl, "streams": streams}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny (default), oracle, qwen3-0.6b or a checkpoint folder")
    parser.add_argument("--num-clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of (generate, serve), best kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    prompts = workload(args.num_clients, args.seed)
    engine_args = ["--max-num-seqs", str(max(256, args.num_clients))]
    total = args.num_clients * args.max_tokens
    gen_walls, serve_runs = [], []
    reference: list[list[int]] | None = None
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        server = Server(args.model, os.path.join(tmp, "serve.tape"), engine_args)
        try:
            for _ in range(args.repeats):
                wall, reference = run_generate(args.model, prompts, args.max_tokens, engine_args, tmp)
                gen_walls.append(wall)
                serve_runs.append(asyncio.run(clients(server.url, args.model, prompts, args.max_tokens)))
        finally:
            server.stop()
    best = min(serve_runs, key=lambda r: r["wall"])
    same = sum(s == r for s, r in zip(best["streams"], reference or []))
    gen_tps, serve_tps = total / min(gen_walls), total / best["wall"]
    result = {
        "model": args.model, "clients": args.num_clients, "max_tokens": args.max_tokens,
        "generate_tok_s": round(gen_tps, 1), "serve_tok_s": round(serve_tps, 1),
        "serving_cost": round(1 - serve_tps / gen_tps, 4),
        "ttft_p50_ms": round(percentile(best["ttft"], 50) * 1e3, 2),
        "ttft_p99_ms": round(percentile(best["ttft"], 99) * 1e3, 2),
        "itl_p50_ms": round(percentile(best["itl"], 50) * 1e3, 3),
        "itl_p99_ms": round(percentile(best["itl"], 99) * 1e3, 3),
        "itl_mean_ms": round(statistics.fmean(best["itl"]) * 1e3, 3) if best["itl"] else None,
        "streams_equal_generate": f"{same}/{args.num_clients}",
        "generate_walls_s": [round(w, 3) for w in gen_walls],
        "serve_walls_s": [round(r["wall"], 3) for r in serve_runs],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"## bench_serve: {args.model}, {args.num_clients} streaming clients x {args.max_tokens} tokens\n")
        print("| measure | value |\n| --- | --- |")
        for key, value in result.items():
            print(f"| {key} | {value} |")
        verdict = "met" if result["serving_cost"] <= 0.10 else "NOT met"
        print(f"\ntarget (serving costs at most 10% of generate's throughput): {verdict}")
    return 0 if same == args.num_clients else 1


if __name__ == "__main__":
    sys.exit(main())
