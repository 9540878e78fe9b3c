"""Serving under load: `tokentape serve` (engine core in its own process, SQLite tape) with N
concurrent streaming clients, against in-process `LLM.generate` on the same workload, in the
same run.

Workload: N prompts (default 64) of seeded random token ids, 32 tokens each, each asking for
M output tokens (default 64), greedy and ignore_eos, so both sides do the same work. The
clients (httpx, one asyncio loop in this process) all start at once, stream with SSE, and
read `token_ids` from each chunk (a minimal HTTP client: the load generator shares the
machine's cores with the server); every stream is checked against the `generate` run's.

Reported: p50 and p99 time to first token (send to the first chunk with a token) and
inter-token latency (the gap between consecutive chunks of a stream, per token), output
tokens/s of both (the best of `--repeats` rounds, alternating), what serving costs:
1 - serve/generate, and the CPU seconds of each serving process in the best round (server,
engine core, tape writer, and this script's clients: on a small machine they share its cores). Target: serving costs at most 10% (on the real model; the oracle's
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
from collections.abc import AsyncIterator
from typing import Any

import msgspec

PROMPT_LEN = 32


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


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

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of the server (HTTP frontend), its engine core and tape writer."""
        core = _children(self.proc.pid)
        writers = [w for c in core for w in _children(c)]
        return {"server": _cpu_s(self.proc.pid), "engine_core": sum(map(_cpu_s, core)),
                "tape_writer": sum(map(_cpu_s, writers))}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        self.proc.wait(120)


async def sse_stream(host: str, port: int, body: bytes) -> AsyncIterator[bytes]:
    """POST /v1/completions and yield each SSE event's JSON: a minimal HTTP/1.1 client (one
    connection per request, chunked body), so the load generator, which shares the machine's
    cores with the server, spends little CPU per token (httpx spends about 3x more)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode(errors="replace") + (await reader.read()).decode(errors="replace"))
        pending = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                return
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {"):
                    yield event[6:]
    finally:
        writer.close()


async def clients(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    ttft: list[float] = []
    itl: list[float] = []
    streams: list[list[int]] = [[] for _ in prompts]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    decode = msgspec.json.Decoder().decode
    warm = msgspec.json.encode({"model": model, "prompt": prompts[0][:4], "max_tokens": 4, "stream": True})
    async for _ in sse_stream(host, int(port), warm):
        pass

    async def one(i: int) -> None:
        body = msgspec.json.encode({"model": model, "prompt": prompts[i], "max_tokens": max_tokens,
                                    "temperature": 0, "ignore_eos": True, "stream": True,
                                    "return_token_ids": True})
        sent = time.perf_counter()
        last = None
        async for event in sse_stream(host, int(port), body):
            got = decode(event)["choices"][0]["token_ids"]
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
                before, mine = server.cpu(), time.process_time()
                run = asyncio.run(clients(server.url, args.model, prompts, args.max_tokens))
                after = server.cpu()
                run["cpu"] = {k: round(after[k] - before[k], 3) for k in after}
                run["cpu"]["clients"] = round(time.process_time() - mine, 3)
                serve_runs.append(run)
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
        "serve_cpu_s": best["cpu"],  # the best round's CPU seconds per process
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
