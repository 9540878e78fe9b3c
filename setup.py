"""Build hook: compile the event core, the KV cache manager, the scheduler and the output
processor with mypyc.

A fold touches every request of every step in Python; compiled, the same source folds about
1.6x faster. A decode step does the same per running request: the scheduler's plan, the
reducer and the outputs; compiled, a step of 256 requests takes about two thirds of the time
(see docs/benchmarks.md). The engine loop and the runners stay interpreted. The compiled
modules are plain, type-checked Python: set TOKENTAPE_PURE_PYTHON=1 to install them as
Python (then nothing needs a C compiler), e.g. to step through the scheduler in a debugger;
`tokentape debug` steps through a recorded run's decisions either way.
Everything else is declared in pyproject.toml.
"""

import glob
import os
import runpy

from setuptools import setup

# The one list of compiled modules is tokentape/events/_compiled.py's (it also finds stale
# builds), read as a file: importing the package here would import torch.
COMPILED = [
    name.replace(".", "/") + ".py"
    for name in runpy.run_path("tokentape/events/_compiled.py")["COMPILED_MODULES"]
]


def ext_modules() -> list:
    if os.environ.get("TOKENTAPE_PURE_PYTHON"):
        # An editable install keeps earlier builds beside the source; they would shadow it.
        for path in _earlier_builds():
            os.remove(path)
        return []
    from mypyc.build import mypycify

    # Type errors are checked in the compiled modules only; what they import stays Python.
    # --no-site-packages keeps mypy out of the installed packages: it would otherwise analyse
    # all of torch (through tokentape/__init__.py), ~85 s per build hook instead of ~7 s. The
    # compiled code is the same: the compiled modules use nothing of torch, and msgspec's
    # objects are reached through Python attribute lookups either way.
    return mypycify(
        ["--follow-imports=silent", "--no-site-packages", "--ignore-missing-imports", *COMPILED],
        opt_level="3",
    )


def _earlier_builds() -> list[str]:
    """Every compiled module of an earlier build (beside its source) and mypyc's runtime."""
    stems = [path.removesuffix(".py") for path in COMPILED]
    return [so for stem in stems for so in glob.glob(f"{stem}.*.so")] + glob.glob("*__mypyc*.so")


setup(ext_modules=ext_modules())
