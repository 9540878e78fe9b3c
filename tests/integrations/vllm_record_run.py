"""Run a scripted workload on vLLM's engine, recorded or not, and write what each client got.

Runs in vLLM's Python (`python vllm_record_run.py SPEC.json`); tests/integrations and
benchmarks/bench_vllm_recorder.py start it. vLLM's LLMEngine is stepped by hand so that
commands land mid-run: requests added at given steps, aborts, `reset_prefix_cache(
reset_running_requests=True)`, and pauses (`pause_scheduler(mode, clear_cache)` through the
engine core, resumed at once). With `"tape"` the engine uses tokentape's RecordingScheduler
and $TOKENTAPE_TAPE names the tape; without it, vLLM's own scheduler.

Spec: {"model": folder, "tape": path | null, "llm": {extra LLM(...) arguments}, "requests":
[{"id", "prompt": [int], "max_tokens", "temperature", "seed", "ignore_eos", "add_at": step}],
"reset_at": [step], "pause_at": [[step, mode, clear_cache]], "abort_at": [[step, id]],
"out": path}. Writes {"outputs": {id: {"tokens", "finish_reason"}}, "vllm": version,
"config": {...}, "steps": n, "seconds": wall time of the stepping}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

RECORDER = "tokentape.integrations.vllm.RecordingScheduler"


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "seed": 0,
        "max_model_len": 128,
        **spec.get("llm", {}),
    }
    if spec.get("tape"):
        os.environ["TOKENTAPE_TAPE"] = spec["tape"]
        kwargs["scheduler_cls"] = RECORDER
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    config = engine.vllm_config
    pending = sorted(spec["requests"], key=lambda r: r.get("add_at", 0))
    resets, pauses = (
        set(spec.get("reset_at", ())),
        {s: (m, c) for s, m, c in spec.get("pause_at", ())},
    )
    aborts: dict[int, list[str]] = {}
    for step, rid in spec.get("abort_at", ()):
        aborts.setdefault(step, []).append(rid)
    outputs: dict[str, dict[str, Any]] = {}
    step = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].get("add_at", 0) <= step:
            r = pending.pop(0)
            params = SamplingParams(
                max_tokens=r["max_tokens"],
                temperature=r.get("temperature", 0.0),
                seed=r.get("seed"),
                ignore_eos=r.get("ignore_eos", True),
                detokenize=False,
            )
            engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]), params)
        if step in resets:
            engine.reset_prefix_cache(reset_running_requests=True)
        if step in pauses:
            mode, clear = pauses[step]
            engine.engine_core.call_utility("pause_scheduler", mode, clear)
            engine.engine_core.call_utility("resume_scheduler")
        if step in aborts:
            engine.abort_request(aborts[step])
            for rid in aborts[step]:
                outputs.setdefault(rid, {"tokens": [], "finish_reason": "abort"})[
                    "finish_reason"
                ] = "abort"
        if engine.has_unfinished_requests():  # else step() would wait for output forever
            for out in engine.step():
                c = out.outputs[0]
                outputs[out.request_id] = {
                    "tokens": list(c.token_ids),
                    "finish_reason": c.finish_reason,
                }
        step += 1
    seconds = time.perf_counter() - t0
    sched = config.scheduler_config
    info = {
        "block_size": config.cache_config.block_size,
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "async_scheduling": sched.async_scheduling,
        "max_num_seqs": sched.max_num_seqs,
        "scheduler_cls": str(sched.scheduler_cls),
    }
    # A timeout long enough for the engine core to close its scheduler (its workers first get 5 s
    # to exit): the tape is then finished, one file. vLLM kills the core, tape writer included,
    # after the default 5 s.
    engine.engine_core.shutdown(timeout=30)
    return {
        "outputs": outputs,
        "vllm": vllm.__version__,
        "config": info,
        "steps": step,
        "seconds": seconds,
    }


if __name__ == "__main__":  # vLLM starts its engine core as a child process
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(spec["out"], "w") as f:
        json.dump(result, f)
