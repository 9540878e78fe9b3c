"""The vLLM runs that are recorded onto tapes, and tokentape's runs of the same workloads.

Each scenario is a spec for one of the two drivers that run in vLLM's Python:
- `vllm_record_run.py`: vLLM's CPU engine (LLMEngine, the exported tiny model; vLLM's CPU
  platform schedules synchronously), stepped by hand with commands mid-run;
- `tokentape.integrations.vllm.scheduler_driver` (run as a module): vLLM's scheduler as its
  engine core drives it, async (a batch queue of depth 2) or sync, with tokentape's oracle as
  the model.
`run_vllm` starts one with vLLM's Python and returns what each client got (`run_vllm_batch`
runs several specs in one process); `run_tokentape`
runs the same requests on tokentape's engine (the tiny model or the oracle), for `diff`.
Used by tests/integrations/test_vllm_recorder.py, tests/tapes/vllm/regenerate.py and
benchmarks/bench_vllm_recorder.py. Standard library and tokentape only: no vLLM here.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENGINE_DRIVER = HERE / "vllm_record_run.py"
SCHEDULER_DRIVER = "tokentape.integrations.vllm.scheduler_driver"  # a module: python -m
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def requests(
    n: int, seed: int, late: int = 0, late_at: int = 0, prefix: str = "r"
) -> list[dict[str, Any]]:
    """n greedy requests with random token prompts; the last `late` of them added at step
    `late_at` (admissions mid-run)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append(
            {
                "id": f"{prefix}{i}",
                "prompt": [rng.randrange(3, 259) for _ in range(rng.randint(10, 40))],
                "max_tokens": rng.randint(20, 48),
                "add_at": late_at if i >= n - late else 0,
            }
        )
    return out


def engine_scenario(model: str) -> dict[str, Any]:
    """vLLM's CPU engine with a KV cache of 8 blocks of 32 tokens (7 usable): KV-pressure
    preemptions; a reset of running requests at step 10; pause(keep, clear_cache) at step 15;
    requests admitted at step 30. Nothing aborted, so the streams diff with tokentape's. The
    model runs eagerly: what is recorded is the scheduler's, and torch.compile would add a
    minute of start-up (tests/integrations/test_vllm_tokens.py runs vLLM compiled)."""
    return {
        "model": model,
        "llm": {
            "block_size": 32,
            "num_gpu_blocks_override": 8,
            "max_num_seqs": 8,
            "enforce_eager": True,
        },
        "requests": requests(12, seed=3, late=2, late_at=30),
        "reset_at": [10],
        "pause_at": [[15, "keep", True]],
    }


def async_scenario(model: str) -> dict[str, Any]:
    """vLLM's AsyncScheduler (depth 2), 14 blocks of 16 tokens: KV-pressure preemptions with a
    step in flight (stale output delivered, #48245), a reset of running requests at step 9
    with a step in flight (stale output dropped), pause(keep, clear_cache) at step 30."""
    return {
        "model": model,
        "async": True,
        "num_blocks": 14,
        "block_size": 16,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 128,
        "requests": requests(12, seed=5, late=4, late_at=20, prefix="a"),
        "reset_at": [9],
        "pause_at": [[30, "keep", True]],
    }


def aborts_scenario(model: str, asynchronous: bool = True) -> dict[str, Any]:
    """The scheduler with aborts: one mid-run, a pause(wait) (running requests finish, nothing
    is admitted) and a pause(abort) that aborts everything left, then late requests."""
    return {
        "model": model,
        "async": asynchronous,
        "num_blocks": 12,
        "block_size": 16,
        "max_num_seqs": 6,
        "max_num_batched_tokens": 128,
        "max_model_len": 128,
        "requests": requests(10, seed=7, late=3, late_at=45, prefix="b"),
        "abort_at": [[6, "b1"]],
        "pause_at": [[12, "wait", False], [25, "abort", True]],
    }


def _two_decoding(model: str) -> dict[str, Any]:
    """Two requests decoding under async scheduling (a batch queue of depth 2), room to spare."""
    return {
        "model": model,
        "async": True,
        "num_blocks": 64,
        "block_size": 16,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 128,
        "requests": [
            {"id": "a", "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 16},
            {"id": "b", "prompt": [21, 22, 23, 24, 25, 26], "max_tokens": 16},
        ],
    }


def pause_resume_scenario(model: str) -> dict[str, Any]:
    """The seed bug's scenario (vLLM #42043): two requests decoding under async scheduling (a
    batch queue of depth 2), pause(keep, clear_cache=True) at step 6, resume. vLLM 0.20-0.21
    drop each request's first token after the resume."""
    return {**_two_decoding(model), "pause_at": [[6, "keep", True]]}


def partial_wake_scenario(model: str) -> dict[str, Any]:
    """An RL loop's sleep (vLLM #44395): the same two requests decoding, sleep(level=1,
    mode="keep") at step 6, then wake_up(tags=["weights"]) at step 8 (where the trainer
    updates the weights) and wake_up(tags=["kv_cache"]) at step 11. vLLM 0.20-0.23 resume
    scheduling at the first wake-up, onto the KV cache still asleep (the device fails there);
    from 0.24 (#44483) they wait for the second."""
    return {
        **_two_decoding(model),
        "sleep_at": [[6, 1, "keep"]],
        "wake_at": [[8, ["weights"]], [11, ["kv_cache"]]],
    }


def spec_reset_scenario(model: str) -> dict[str, Any]:
    """Speculative decoding (2 drafts) under async scheduling, with resets of running requests
    while a step is in flight (steps 9 and 21): the step in flight holds 1 + 2 placeholders per
    request. vLLM 0.22-0.26 set the discard counter to them and drain it one frame at a time,
    so after the stale frame two fresh ones are dropped (#42117's token-unit counter); until
    0.25, the dropped stale frame's rejected drafts come off the resumed request's placeholders
    (#46066)."""
    return {
        "model": model,
        "async": True,
        "num_blocks": 64,
        "block_size": 16,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "max_model_len": 128,
        "num_speculative_tokens": 2,
        "requests": requests(6, seed=11, prefix="s"),
        "reset_at": [9, 21],
    }


def padded_admission_scenario(model: str) -> dict[str, Any]:
    """Two drafts per step under async scheduling and a KV cache of 12 blocks of 16 tokens:
    KV-pressure preemptions, and a request admitted again whose prefix-cache hit leaves one
    token to compute, which vLLM (0.26 on) pads with -1 drafts to the uniform decode size
    (`pad_spec_decode`). What a chaos storm against vLLM 0.32.0 first took for #40768; the
    shrink of that storm, with its prompts made regular."""
    r2 = [(5 * i + 11) % 250 + 3 for i in range(34)]
    return {
        "model": model,
        "async": True,
        "num_blocks": 12,
        "block_size": 16,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 48,
        "max_model_len": 176,
        "num_speculative_tokens": 2,
        "seed": 29,
        "requests": [
            {
                "id": "r1",
                "prompt": [(3 * i + 7) % 250 + 3 for i in range(76)],
                "max_tokens": 6,
                "add_at": 1,
            },
            {"id": "r2", "prompt": r2, "max_tokens": 14},
            {"id": "r5", "prompt": r2[:10], "max_tokens": 2},
            {"id": "r7", "prompt": [(7 * i + 2) % 250 + 3 for i in range(13)], "max_tokens": 13},
        ],
    }


def run_vllm(
    python: str,
    driver: Path | str,
    spec: dict[str, Any],
    workdir: Path,
    name: str,
    tape: bool = True,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run a driver in vLLM's Python (with `env` added: another release's overlay,
    benchmarks/baselines/vllm_releases.py); returns its result with "tape" (the path, or None)."""
    return run_vllm_batch(python, driver, {name: spec}, workdir, tape, timeout, env)[name]


def run_vllm_batch(
    python: str,
    driver: Path | str,
    specs: dict[str, dict[str, Any]],
    workdir: Path,
    tape: bool = True,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Several specs, by name, run one after the other in one process of the driver (a script,
    or a module by name): vLLM is imported once (about 10 s on a 2-core machine) rather than
    once per spec. The driver imports this tokentape (its source tree first on PYTHONPATH,
    after a release's overlay)."""
    from tokentape.integrations.vllm.driver_process import tokentape_source_root

    written = {
        name: {
            **spec,
            "tape": str(workdir / f"{name}.tape") if tape else None,
            "out": str(workdir / f"{name}.json"),
        }
        for name, spec in specs.items()
    }
    paths = [workdir / f"{name}.spec.json" for name in written]
    for path, spec in zip(paths, written.values()):
        path.write_text(json.dumps(spec))
    log_path = workdir / f"{'+'.join(specs)}.log"
    full_env = {**os.environ, **VLLM_ENV, **(env or {})}
    root = tokentape_source_root()
    if root is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (full_env.get("PYTHONPATH"), str(root)) if p
        )
    command = [python, "-m", driver] if isinstance(driver, str) else [python, str(driver)]
    name = driver if isinstance(driver, str) else driver.name
    with open(log_path, "wb") as log:
        proc = subprocess.run(
            [*command, *map(str, paths)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=workdir,
            timeout=timeout,
        )
    if proc.returncode != 0:
        tail = log_path.read_bytes()[-3000:].decode(errors="replace")
        raise RuntimeError(
            f"{name} {', '.join(specs)} failed (exit {proc.returncode}); end of {log_path}:\n{tail}"
        )
    results = {}
    for name, spec in written.items():
        result: dict[str, Any] = json.loads(Path(spec["out"]).read_text())
        result["tape"] = spec["tape"]
        results[name] = result
    return results


def run_tokentape(spec: dict[str, Any], model: str, tape: Path) -> dict[str, list[int]]:
    """The scenario's requests on tokentape's own engine (no commands: the streams must not
    depend on them): what each client got."""
    from tokentape import LLM, SamplingParams

    llm = LLM(model=model, seed=0, tape=str(tape), max_model_len=spec.get("max_model_len", 128))
    engine = llm.llm_engine
    for r in spec["requests"]:
        engine.add_request(
            r["id"],
            r["prompt"],
            SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True),
        )
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = list(out.outputs[0].token_ids)
    llm.close()
    return got
