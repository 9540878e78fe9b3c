"""Drive a side script (sideserver protocol) from the tokentape side (stdlib only)."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class SideError(RuntimeError):
    """The side process failed or stopped; the message ends with the tail of its log."""


class SideProcess:
    """A side script started with `python`, its spec written to a JSON file; its stderr (and
    everything its libraries print) goes to a log file, kept for the report on failure.

    `start()` waits for the `ready` reply (vLLM's first start compiles for ~40 s); `call(cmd,
    **args)` sends one command and returns its reply; `close()` asks it to quit, then waits.
    """

    def __init__(
        self,
        python: str,
        script: str,
        spec: dict[str, Any],
        *,
        label: str,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
    ) -> None:
        self.label = label
        self._dir = tempfile.mkdtemp(prefix=f"tokentape-{label}-", dir=workdir)
        spec_path = os.path.join(self._dir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        self.log_path = os.path.join(self._dir, "log.txt")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [python, str(HERE / script), spec_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **(env or {})},
            cwd=self._dir,
        )
        self._buf = b""
        self.failed = False
        self.info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def _fail(self, what: str) -> SideError:
        self.failed = True  # keep the log for the report
        return SideError(f"{self.label}: {what}\n--- end of {self.log_path} ---\n{self.log_tail()}")

    def _read_reply(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"no reply within {timeout:.0f} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    code = self.proc.wait()
                    raise self._fail(f"the process stopped (exit code {code})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise self._fail(reply.get("error", "failed"))
        return reply

    def start(self, timeout: float = 1800.0) -> dict[str, Any]:
        self.info = self._read_reply(timeout)["ready"]
        return self.info

    def call(self, cmd: str, timeout: float = 3600.0, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._fail("the process stopped") from None
        return self._read_reply(timeout)

    def close(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit", timeout=timeout)
            except (SideError, OSError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # our own child, by its handle
                self.proc.wait()
        self._log.close()
        if not self.failed:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> SideProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
