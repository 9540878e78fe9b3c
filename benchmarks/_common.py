"""Shared helpers for the benchmark scripts (not a benchmark itself).

Every benchmark measures its candidate and its baseline in the same process, in alternation
(ABAB...), after a warm-up, and keeps the best of N repeats (`time.perf_counter`). Results are
printed as a markdown table; `--json PATH` also writes them for `run_all.py`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from tokentape.events.sqlite_store import remove_tape_files


def parse_args(description: str, default_repeats: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--repeats", type=int, default=default_repeats,
                   help=f"timed repeats per variant, best kept (default {default_repeats})")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return p.parse_args()


def machine_info() -> dict[str, str]:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import msgspec

    import tokentape

    return {
        "cpu": f"{cpu}, {os.cpu_count()} logical CPUs",
        "os": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "sqlite": sqlite3.sqlite_version,
        "msgspec": msgspec.__version__,
        "tokentape": tokentape.__version__,
    }


@contextmanager
def gc_collected():
    """Start a timed region from a clean heap (GC stays enabled, as in real use)."""
    gc.collect()
    yield


def best_of(
    variants: dict[str, Callable[[], float]], repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Run each variant `warmup` times untimed, then `repeats` times in alternation.

    Each callable returns the elapsed seconds of its own timed region (so that setup, such
    as creating a fresh file, stays outside the timing). Returns the best time per variant.
    """
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    best = {name: float("inf") for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            best[name] = min(best[name], fn())
    return best


class TempDir:
    """A scratch directory with fresh, unique file names; removed at exit."""

    def __init__(self) -> None:
        self._td = tempfile.TemporaryDirectory(prefix="tokentape-bench-")
        self.path = self._td.name
        self._n = 0

    def new(self, stem: str = "t", suffix: str = ".tape") -> str:
        self._n += 1
        return os.path.join(self.path, f"{stem}{self._n}{suffix}")

    def cleanup(self) -> None:
        self._td.cleanup()


def cache_dir(arg: str | None = None) -> str:
    """Where large recorded tapes are kept between runs (never committed)."""
    base = arg or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                               "tokentape")
    os.makedirs(base, exist_ok=True)
    return base


remove_db = remove_tape_files  # the benchmarks' name for it


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    def cell(x: Any) -> str:
        return x if isinstance(x, str) else f"{x}"

    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def emit(results: dict[str, Any], markdown: str, json_path: str | None) -> None:
    print(markdown)
    sys.stdout.flush()
    if json_path:
        results = dict(results, markdown=markdown)
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)


# -- the decode-step workload shared by bench_step_overhead and bench_vs_vllm -------------------

PROMPT_LEN = 128
MAX_TOKENS = 256
BLOCK_SIZE = 16
SKIP_CALLS = 4  # step() calls before the timed window: the prefill and the pipeline filling
WINDOW_CALLS = 240  # timed step() calls: every one schedules a decode for every request


def _noop() -> None:
    pass


def step_engine_kwargs(num_requests: int, async_scheduling: bool) -> dict[str, Any]:
    blocks_per_req = -(-(PROMPT_LEN + MAX_TOKENS) // BLOCK_SIZE)
    return dict(
        async_scheduling=async_scheduling,
        pipeline_depth=2,
        block_size=BLOCK_SIZE,
        num_kv_blocks=max(256, num_requests) * blocks_per_req + 256,  # never preempts
        max_num_batched_tokens=65536,  # every prefill fits in the first step
        max_num_seqs=max(256, num_requests),
    )


def make_prompts(num_requests: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(PROMPT_LEN)] for _ in range(num_requests)]


def time_decode_steps(
    num_requests: int,
    async_scheduling: bool,
    tape: str | bool | None,
    hooks: tuple[Callable[[], object], Callable[[], object]] | None = None,
) -> float:
    """Seconds per `engine.step()` over WINDOW_CALLS steps in which every request decodes.

    Builds a fresh engine (tape: an SQLite file path, None for the in-memory tape, or False
    for the NullTape), adds the
    requests, runs SKIP_CALLS untimed steps (all prefills happen in the first), checks that
    every request is in decode, times the window, then checks that nothing was preempted or
    finished inside it, and runs the engine to completion untimed. `hooks` (start, stop) are
    called around the timed window, e.g. to profile it.
    """
    from tokentape import LLM, SamplingParams

    llm = LLM(model="oracle", tape=tape, **step_engine_kwargs(num_requests, async_scheduling))
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(num_requests)):
        engine.add_request(str(i), prompt, params)
    step = engine.step
    for _ in range(SKIP_CALLS):
        step()
    state = engine.state
    assert not state.waiting and len(state.running) == num_requests, "not all requests running"
    assert all(r.num_computed_tokens >= r.num_prompt_tokens for r in state.requests.values()), \
        "a prefill is still pending"
    step_before = state.step
    # An SQLite tape's writer process starts alongside the engine (tens of ms): the window
    # begins once it runs and has caught up; the flush after the window counts any backlog.
    engine.tape.flush()
    start, stop = hooks or (_noop, _noop)
    with gc_collected():
        start()
        t0 = time.perf_counter()
        for _ in range(WINDOW_CALLS):
            step()
        engine.tape.flush()  # the tape's background writer has finished the window's steps
        elapsed = time.perf_counter() - t0
        stop()
    assert state.step - step_before == WINDOW_CALLS, "a step scheduled nothing"
    assert all(r.num_preemptions == 0 and not r.is_finished for r in state.requests.values()), \
        "a request was preempted or finished inside the timed window"
    while engine.has_unfinished_requests():
        step()
    assert all(len(r.output_token_ids) == MAX_TOKENS for r in state.requests.values())
    llm.close()
    return elapsed / WINDOW_CALLS
