"""Find the Python interpreter that runs a baseline (tokentape side).

vLLM: `--vllm-python PATH`, else `$TOKENTAPE_VLLM_PYTHON`, else `.venv-vllm/bin/python` in the
repository root (what `benchmarks/setup_vllm_venv.sh` makes), else this interpreter if it
can import `vllm`: the search tokentape's chaos driver makes (find_vllm). transformers: this
interpreter if it has transformers, else vLLM's Python (vLLM depends on transformers). Each
probe reads package metadata in a child process without importing the package, so it takes
well under a second.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

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
    """(where vLLM is, or None; one line that says what was found or why not): the package's
    own search (tokentape.integrations.vllm.driver_process.find_vllm, the chaos driver's)."""
    from tokentape.integrations.vllm.driver_process import VLLMNotFound
    from tokentape.integrations.vllm.driver_process import find_vllm as find

    try:
        found = find(explicit)
    except VLLMNotFound as exc:
        return None, str(exc)
    line = f"vLLM {found.version}: {found.python} ({found.source})"
    return Found(found.python, found.source, found.version), line


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
