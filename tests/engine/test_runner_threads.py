"""The runner's parallel torch work runs on its worker thread, and its build on a thread that
ends with it: a thread that runs a parallel region keeps an OpenMP team for good, and a second
team beside the worker's makes libgomp cut the spin-waits of both (runners/worker.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

import tokentape.engine.model.loader as loader
import tokentape.engine.runners.model_runner as model_runner
from tokentape import LLM, SamplingParams
from tokentape.engine.model.loader import builtin_model
from tokentape.engine.runners.worker import ModelWorker, on_a_thread_of_its_own

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def test_a_job_on_a_thread_of_its_own_leaves_no_openmp_team_behind() -> None:
    """Counted in a fresh process, where no earlier test left teams: the job's matmul runs on
    two threads, and the process has as many threads after it as before; the same matmul on
    the caller's thread leaves its team's thread behind."""
    code = textwrap.dedent(
        """
        import os, time, torch
        from tokentape.engine.runners.worker import on_a_thread_of_its_own
        torch.set_num_threads(2)
        def threads():
            return len(os.listdir("/proc/self/task"))
        def settled(at_most):
            # A team's threads leave once told to (their master has ended): a moment's wait.
            for _ in range(100):
                if threads() <= at_most:
                    break
                time.sleep(0.01)
            return threads()
        def matmul():
            a = torch.ones(512, 512)
            return float((a @ a).sum())
        before = threads()
        assert on_a_thread_of_its_own(matmul) == 512.0 ** 3
        after = settled(before)
        matmul()
        print(before, after, threads())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after, with_own_team = map(int, out.stdout.split())
    assert after == before
    assert with_own_team == before + 1


def test_its_outcome_and_its_exception_are_the_callers() -> None:
    assert on_a_thread_of_its_own(threading.get_ident) != threading.get_ident()
    with pytest.raises(ValueError, match="bad"):
        on_a_thread_of_its_own(lambda: int("bad"))


def test_a_call_from_a_job_on_the_worker_runs_at_once() -> None:
    worker = ModelWorker(1)
    try:
        assert worker.call(lambda: worker.call(lambda: 7) + 1) == 8
    finally:
        worker.close()


def test_the_build_sleep_wake_and_weight_updates_run_off_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, int] = {}
    builds: list[int] = []

    def builtin(*args: Any, **kw: Any) -> Any:
        builds.append(threading.get_ident())
        return builtin_model(*args, **kw)

    monkeypatch.setattr(loader, "builtin_model", builtin)  # the build imports it when it runs
    real_apply = model_runner.apply_update

    def apply(*args: Any, **kw: Any) -> Any:
        seen["update"] = threading.get_ident()
        return real_apply(*args, **kw)

    monkeypatch.setattr(model_runner, "apply_update", apply)
    llm = LLM("tiny", tape=None, num_kv_blocks=32, block_size=16)
    try:
        runner = llm.llm_engine.engine_core.runner
        worker = runner._worker._thread.ident  # type: ignore[attr-defined]
        first = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        llm.llm_engine.pause_generation(mode="keep")
        llm.llm_engine.update_weights(builtin_model("tiny", seed=0)[1].state_dict())
        llm.llm_engine.resume_generation()
        llm.sleep(level=2)
        llm.wake_up()
        again = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.close()
    assert list(again) == list(first)  # the same weights, rebuilt from the seed
    mine = threading.get_ident()
    assert len(builds) == 2 and builds[0] not in (mine, worker)  # a thread of its own
    assert builds[1] == worker and seen["update"] == worker  # the wake-up's rebuild
