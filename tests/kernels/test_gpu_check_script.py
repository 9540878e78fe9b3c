"""benchmarks/gpu_check.py where there is no GPU: its message, its checks under the
interpreter, and the ahead-of-time compile of every kernel for sm_90."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kernel_cases  # noqa: F401  (turns the interpreter on before triton is imported)
import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default; silences triton 3.9's warning
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_gpu_check_without_cuda_says_so_and_exits_cleanly() -> None:
    proc = run_script()
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout and "nothing checked" in proc.stdout


def test_gpu_check_passes_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    proc = run_script("--cpu-interpret")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.split("== summary ==")[1]
    assert summary.count("PASS") == 10 and "0 failed" in summary, summary


def test_every_kernel_compiles_for_sm90() -> None:
    """What the interpreter cannot show: the kernels compile for a real GPU (no GPU needed)."""
    pytest.importorskip("triton.backends.nvidia")
    proc = run_script("--compile-only", "--arch", "90")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout.split("== summary ==")[1]
    assert summary.count("PASS  compile") == 16 and "0 failed" in summary, summary


def test_a_part_that_raises_is_a_failure_and_the_rest_still_runs() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
    try:
        spec.loader.exec_module(gpu_check)
    finally:
        del sys.modules["gpu_check"]

    def broken() -> list[object]:
        raise IndexError("a kernel failed")

    [result] = gpu_check.stage("broken part", broken)
    assert result.ok is False and "IndexError" in result.detail
    assert gpu_check.summarize([result, gpu_check.Result("fine", True, "")]) == 1
