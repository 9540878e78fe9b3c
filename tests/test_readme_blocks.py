"""Every code block of README.md runs, as a user would run it, in a fresh folder: `sh` blocks
through bash (`tokentape` is this checkout's CLI), `python` blocks through this Python. A
block that needs files the README makes elsewhere gets them from the README's own commands
first (SETUP); a `tokentape serve` line starts the server in the background on a free port
(the block's `localhost:8000` points there) and waits until it serves, as a user waits before
the next command in another terminal. `pip install` steps are not run here (they would
replace this environment's install); what they install must exist (the extras they name).

Blocks that need what this suite cannot give run elsewhere, named in ELSEWHERE; a README block
that is in neither table fails the test, so a new block cannot go unrun.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int

    @property
    def key(self) -> str:
        """The block's first line, without its comment: how the tables below name it."""
        return re.sub(r"\s+#\s.*$", "", self.text.strip().splitlines()[0])


def readme_blocks() -> list[Block]:
    text = (ROOT / "README.md").read_text()
    return [
        Block(m.group(1), m.group(2), text[: m.start()].count("\n") + 1)
        for m in re.finditer(r"^```(\w+)\n(.*?)^```", text, re.S | re.M)
    ]


GENERATE_RUN = 'tokentape generate "Hello" --max-tokens 32 --tape run.tape'  # README, Replay
QUICK_START = "tokentape generate --discard-policy flag --pipeline-depth 2 --pause-at 4"

# Files a block reads that the README makes in other blocks: those blocks' own commands.
SETUP: dict[str, str] = {
    "tokentape postmortem run.tape": "\n".join(
        [
            GENERATE_RUN,
            "cp run.tape good.tape && mkdir tapes && cp run.tape tapes/engine-0.tape",
            # `pytest --tokentape-dir tapes/` runs the user's tests: here, one engine test.
            "printf 'from tokentape import LLM, SamplingParams\\n\\n\\ndef test_tiny():\\n"
            '    LLM("tiny", tape=None).generate([[5, 6]], SamplingParams(max_tokens=2))\\n\''
            " > test_engine.py",
        ]
    ),
    "from tokentape.replay import load_tape, fold, verify": GENERATE_RUN,
    "tokentape debug run.tape": "\n".join(
        [
            GENERATE_RUN,
            f"{QUICK_START} --tape bug.tape",
            f"{QUICK_START} --tape ci.tape",  # CI's run had vLLM's old flag policy ...
            "tokentape generate --pipeline-depth 2 --pause-at 4 --tape local.tape",  # ... not here
        ]
    ),
    "from tokentape.replay import load_tape, diff, whatif, build_timeline": "\n".join(
        [
            GENERATE_RUN,
            f"{QUICK_START} --tape flag.tape",
            "tokentape generate --pipeline-depth 2 --pause-at 4 --tape epoch.tape",
        ]
    ),
}
# Blocks that continue an earlier one (its Python state, or its running server).
CONTINUES: dict[str, str] = {
    "from tokentape.engine.model.loader import builtin_model": "from tokentape import LLM, "
    "SamplingParams",
    "from openai import OpenAI": "pip install -e '.[serve]'",
}
# Commands whose documented exit status is not 0 (a finding, a difference).
EXIT_1 = (
    "tokentape postmortem bug.tape",
    "tokentape diff ci.tape local.tape",
    "tokentape bisect ci.tape local.tape",
    "tokentape replay whatif vllm.tape",
    "tokentape diff vllm.tape tokentape.tape",
)
ELSEWHERE: dict[str, str] = {
    (
        "pip install torch==2.13.0 && pip install -e '.[test]' "
        "&& python -m pytest -q -n 2 --dist loadfile"
    ): "the whole suite: .ci/run runs it",
    "pip install -e '.[serve,ray]'": (
        "examples/rlhf_ray.py on Ray: tests/entrypoints/test_rlhf_ray.py"
    ),
    "import os": "vLLM itself: test_vllm_blocks_run below (vllm mark)",
    "tokentape replay verify vllm.tape": "a vLLM tape: test_vllm_blocks_run below (vllm mark)",
    "benchmarks/setup_vllm_venv.sh": (
        "vLLM's releases: tests/integrations/test_vllm_releases.py (vllm mark)"
    ),
    "pytest -p tokentape --tokentape-record-vllm tapes/ tests/v1/core": (
        "a vLLM checkout: tests/integrations/test_vllm_ci_plugin.py (vllm mark)"
    ),
}

START_SERVER = r"""
start_server() {  # `tokentape serve ARGS`, in the background, until it serves
    tokentape serve "$@" --port "$PORT" 2> server.log &
    SERVER_PID=$!
    for _ in $(seq 600); do
        grep -q "serving on" server.log && return 0
        kill -0 "$SERVER_PID" 2> /dev/null || { cat server.log; return 1; }
        sleep 0.2
    done
    cat server.log; return 1
}
stop_server() { [ -z "${SERVER_PID:-}" ] || { kill -TERM "$SERVER_PID"; wait "$SERVER_PID"; }; }
trap stop_server EXIT
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shell_lines(block: Block, port: int) -> list[str]:
    """The block's commands for bash: comments and pip steps out, serve lines backgrounded,
    the port a free one, and a documented exit status of 1 required."""
    lines = []
    for line in block.text.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#\s.*$", "", line)  # a trailing comment (never inside quotes here)
        line = re.sub(r"pip install [^&]*(&& )?", "", line).strip()
        if not line:
            continue
        if line.startswith("tokentape serve"):
            line = "start_server" + re.sub(r"\s--port \d+", "", line[len("tokentape serve") :])
        if line.startswith(EXIT_1):
            line = f"{{ {line} && exit 97; }} || [ $? -eq 1 ]"  # 97: it did not find it
        lines.append(line.replace("localhost:8000", f"localhost:{port}"))
    return lines


def extras_named(text: str) -> set[str]:
    return {e for m in re.findall(r"\.\[([a-z,]+)\]", text) for e in m.split(",")}


def run(script: str, cwd: Path, port: int) -> subprocess.CompletedProcess[str]:
    bin_dir = cwd / ".bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "tokentape").write_text(
        f'#!/bin/sh\nexec "{sys.executable}" -m tokentape.cli "$@"\n'
    )
    (bin_dir / "tokentape").chmod(0o755)
    for name in ("python", "pytest"):
        target = f'exec "{sys.executable}"' + (" -m pytest" if name == "pytest" else "")
        (bin_dir / name).write_text(f'#!/bin/sh\n{target} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "PORT": str(port),
    }
    return subprocess.run(
        ["bash", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=900,
    )


def as_script(block: Block, port: int, blocks: dict[str, Block]) -> str:
    """The block, after the block it continues, with its setup first, as one bash script."""
    chain = [block]
    while chain[0].key in CONTINUES:
        chain.insert(0, blocks[CONTINUES[chain[0].key]])
    lines = ["set -e -o pipefail", START_SERVER, SETUP.get(block.key, "")]
    python = [b.text for b in chain if b.lang == "python"]
    for b in chain:
        if b.lang == "sh":
            lines += shell_lines(b, port)
    if python:  # after the shell part (a server it started is up), one Python process
        source = "\n".join(python).replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        lines.append(f"python - <<'PYTHON_BLOCK'\n{source}\nPYTHON_BLOCK")
    return "\n".join(lines)


BLOCKS = readme_blocks()
BY_KEY = {b.key: b for b in BLOCKS}


def test_every_block_is_run_here_or_elsewhere() -> None:
    assert len(BY_KEY) == len(BLOCKS), "two README blocks begin alike"
    continued = set(CONTINUES.values())
    for b in BLOCKS:
        assert b.key not in ELSEWHERE or b.key not in continued, b.key
    assert set(ELSEWHERE) <= set(BY_KEY), set(ELSEWHERE) - set(BY_KEY)
    assert set(SETUP) | set(CONTINUES) <= set(BY_KEY)
    # What the pip steps install exists.
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    for b in BLOCKS:
        assert extras_named(b.text) <= extras, (b.line, extras_named(b.text) - extras)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}" for b in BLOCKS])
def test_readme_block_runs(block: Block, tmp_path: Path) -> None:
    if block.key in ELSEWHERE:
        pytest.skip(f"README line {block.line}: {ELSEWHERE[block.key]}")
    port = free_port()
    out = run(as_script(block, port, BY_KEY), tmp_path, port)
    assert out.returncode == 0, (
        f"README line {block.line}:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    )


@pytest.mark.vllm
def test_vllm_blocks_run(tmp_path: Path) -> None:
    """README's vLLM recording example in vLLM's Python (tokentape on its path), then the
    commands that read its tape in this one."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from baselines.locate import find_vllm

    found, where = find_vllm()
    if found is None:
        pytest.skip(where)
    (tmp_path / "record.py").write_text(BY_KEY["import os"].text)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    out = subprocess.run(
        [found.python, "record.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0 and (tmp_path / "vllm.tape").exists(), out.stderr[-5000:]
    port = free_port()
    script = as_script(BY_KEY["tokentape replay verify vllm.tape"], port, BY_KEY)
    shown = run(script, tmp_path, port)
    assert shown.returncode == 0, f"{shown.stdout[-3000:]}\n{shown.stderr[-3000:]}"
    assert "recorded by vllm" in shown.stdout and "no findings" in shown.stdout
