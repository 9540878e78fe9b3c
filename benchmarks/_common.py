"""Shared helpers for the benchmark scripts (not a benchmark itself).

Every benchmark measures its candidate and its baseline in the same run, in alternation
(ABAB...), after a warm-up, and keeps the best of N repeats (`time.perf_counter`): in the same
process, or for vLLM and transformers in a side process started once (benchmarks/baselines).
Results are printed as a markdown table; `--json PATH` also writes them for `run_all.py`.
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
from dataclasses import dataclass
from typing import Any, TypeVar

from baselines import procstat

from tokentape.engine.model.model_config import TINY, ModelConfig
from tokentape.engine.tokenizer import byte_tokenizer_json
from tokentape.events.sqlite_store import remove_tape_files

T = TypeVar("T")


def parse_args(description: str, default_repeats: int) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--repeats",
        type=int,
        default=default_repeats,
        help=f"timed repeats per variant, best kept (default {default_repeats})",
    )
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
    variants: dict[str, Callable[[], T]],
    repeats: int,
    warmup: int = 1,
    key: Callable[[T], float] = float,  # type: ignore[assignment]
) -> dict[str, T]:
    """Run each variant `warmup` times untimed, then `repeats` times in alternation.

    Each callable returns the elapsed seconds of its own timed region (so that setup, such
    as creating a fresh file, stays outside the timing), or a result that `key` maps to
    them. Returns the best (lowest `key`) result per variant.
    """
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    best: dict[str, T] = {}
    for _ in range(repeats):
        for name, fn in variants.items():
            result = fn()
            if name not in best or key(result) < key(best[name]):
                best[name] = result
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
    base = arg or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokentape"
    )
    os.makedirs(base, exist_ok=True)
    return base


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs, from /proc/stat (Linux); (0, 0) elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def busy_cores(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    db, dt = after[0] - before[0], after[1] - before[1]
    return None if dt <= 0 else db / dt * (os.cpu_count() or 1)


remove_db = remove_tape_files  # the benchmarks' name for it


def write_tokenizer(folder: str, config: ModelConfig = TINY) -> str:
    """The built-in models' byte tokenizer as a Hugging Face folder that vLLM's client and
    `vllm serve` load: tokenizer.json (`byte_tokenizer_json`, which encodes text as tokentape's
    ByteTokenizer does) and a tokenizer_config.json that names the plain fast tokenizer and its
    special tokens (without it, transformers (5.x) picks Qwen2Tokenizer for a qwen3 folder, which
    adds its default <|endoftext|> as token 259, past tiny's vocabulary, and takes it for the
    EOS), and `config`'s config.json unless the folder has one already (vLLM's get_tokenizer
    reads a model type from it)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write(byte_tokenizer_json())
    specials = {"bos_token": "<|tokentape:bos|>", "eos_token": "<|tokentape:eos|>"}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **specials,
                "pad_token": "<|tokentape:pad|>",
                "model_max_length": config.max_position_embeddings,
            },
            f,
        )
    if not os.path.exists(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config.to_hf_dict(), f)
    return folder


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


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Per decode step: wall seconds, and CPU seconds of each process that worked for it."""

    wall_s: float
    engine_cpu_s: float  # the engine's process, every thread of it (`time.process_time`)
    writer_cpu_s: float  # the SQLite tape's writer process (0 without one)
    # Wall seconds of the step inside the runner (the oracle computing the tokens: its submit
    # and collect) and inside the output processor (the RequestOutputs, which vLLM builds in
    # its frontend process): parts a step of vLLM's scheduler alone does not include.
    runner_s: float = 0.0
    outputs_s: float = 0.0

    @property
    def wall_plus_writer_s(self) -> float:
        """The engine's wall time plus the writer's CPU time: what a step costs the machine
        beyond one busy core (the writer runs on another core, off the engine's path)."""
        return self.wall_s + self.writer_cpu_s

    @property
    def scheduling_s(self) -> float:
        """wall_plus_writer_s less the runner and the output processor: the scheduler, the
        reducer and the tape, what vLLM's schedule() + update_from_output() do."""
        return self.wall_plus_writer_s - self.runner_s - self.outputs_s


class _Stopwatch:
    """Sums the wall time of calls to wrapped methods, by label, while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, float] = {}

    def wrap(self, obj: Any, method: str, label: str) -> None:
        inner = getattr(obj, method)
        clock = time.perf_counter
        self.seconds[label] = 0.0

        def timed(*args: Any) -> Any:
            if not self.on:
                return inner(*args)
            t0 = clock()
            try:
                return inner(*args)
            finally:
                self.seconds[label] += clock() - t0

        setattr(obj, method, timed)


def time_decode_steps(
    num_requests: int,
    async_scheduling: bool,
    tape: str | bool | None,
    hooks: tuple[Callable[[], object], Callable[[], object]] | None = None,
) -> float:
    """Wall seconds per `engine.step()`: `measure_decode_steps(...).wall_s`."""
    return measure_decode_steps(num_requests, async_scheduling, tape, hooks).wall_s


def measure_decode_steps(
    num_requests: int,
    async_scheduling: bool,
    tape: str | bool | None,
    hooks: tuple[Callable[[], object], Callable[[], object]] | None = None,
) -> StepTimes:
    """Wall and CPU seconds per `engine.step()` over WINDOW_CALLS steps in which every request
    decodes.

    Builds a fresh engine (tape: an SQLite file path, None for the in-memory tape, or False
    for the NullTape), adds the requests, runs SKIP_CALLS untimed steps (all prefills happen
    in the first), checks that every request is in decode, times the window, then checks that
    nothing was preempted or finished inside it, and runs the engine to completion untimed.
    CPU time: this process (`time.process_time`, every thread) and the tape's writer process
    (its CPU clock, by pid), over the same window. `hooks` (start, stop) are called around
    the timed window, e.g. to profile it.
    """
    from tokentape import LLM, SamplingParams

    llm = LLM(model="oracle", tape=tape, **step_engine_kwargs(num_requests, async_scheduling))
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(num_requests)):
        engine.add_request(str(i), prompt, params)
    watch = _Stopwatch()
    watch.wrap(engine.engine_core.runner, "submit", "runner")
    watch.wrap(engine.engine_core.runner, "collect", "runner")
    # The output processor is compiled (no method can be wrapped on it): its share is
    # the front end's step() less the core's, which is everything step() does before it.
    watch.wrap(engine.engine_core, "step", "core")
    watch.wrap(engine, "step", "step")
    step = engine.step
    for _ in range(SKIP_CALLS):
        step()
    state = engine.engine_core.state
    assert not state.waiting and len(state.running) == num_requests, "not all requests running"
    assert all(r.num_computed_tokens >= r.num_prompt_tokens for r in state.requests.values()), (
        "a prefill is still pending"
    )
    step_before = state.step
    writer_pid: int | None = getattr(engine.engine_core.tape, "writer_pid", None)
    # An SQLite tape's writer process starts alongside the engine (tens of ms): the window
    # begins once it runs and has caught up; the flush after the window counts any backlog.
    engine.engine_core.tape.flush()
    start, stop = hooks or (_noop, _noop)
    with gc_collected():
        start()
        watch.on = True
        w0 = procstat.cpu_seconds(writer_pid) if writer_pid else 0.0
        c0 = time.process_time()
        t0 = time.perf_counter()
        for _ in range(WINDOW_CALLS):
            step()
        # the tape's background writer has finished the window's steps
        engine.engine_core.tape.flush()
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0
        writer_cpu = procstat.cpu_seconds(writer_pid) - w0 if writer_pid else 0.0
        watch.on = False
        stop()
    assert state.step - step_before == WINDOW_CALLS, "a step scheduled nothing"
    assert all(r.num_preemptions == 0 and not r.is_finished for r in state.requests.values()), (
        "a request was preempted or finished inside the timed window"
    )
    while engine.has_unfinished_requests():
        step()
    assert all(len(r.output_token_ids) == MAX_TOKENS for r in state.requests.values())
    llm.close()
    return StepTimes(
        elapsed / WINDOW_CALLS,
        cpu / WINDOW_CALLS,
        writer_cpu / WINDOW_CALLS,
        watch.seconds["runner"] / WINDOW_CALLS,
        (watch.seconds["step"] - watch.seconds["core"]) / WINDOW_CALLS,
    )
