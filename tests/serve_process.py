"""A `tokentape serve` process for tests (`python -m tokentape.entrypoints.api_server`, the
same arguments): started on 127.0.0.1 on a free port (the server picks it: --port 0) and
always stopped, by SIGTERM to its own pid."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

_SERVING = re.compile(r"serving on (http://[0-9.]+:[0-9]+)")


class ServerProcess:
    def __init__(
        self,
        *args: str,
        startup_timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
        port: int = 0,
    ) -> None:
        cmd = [
            sys.executable,
            "-m",
            "tokentape.entrypoints.api_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.lines: list[str] = []
        self._url = threading.Event()
        self.url = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        started = time.monotonic()
        while not self._url.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() - started > startup_timeout_s:
                self.stop(timeout_s=10)
                raise RuntimeError("the server did not start:\n" + "".join(self.lines))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = _SERVING.search(line)
            if m:
                self.url = m.group(1)
                self._url.set()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    @property
    def core_pid(self) -> int:
        """The pid of the server's engine core process (its only child that is Python's)."""
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            children = [int(p) for p in f.read().split()]
        for pid in children:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tokentape.engine.core.engine_core_proc" in f.read():
                    return pid
        raise RuntimeError(f"no engine core among the server's children {children}")

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until the engine runs nothing and nothing waits (read from /metrics): a client that
        left has had its request aborted by then, before any shutdown."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            text = httpx.get(f"{self.url}/metrics").text
            busy = [
                line
                for line in text.splitlines()
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
                and not line.endswith(" 0.0")
            ]
            if not busy:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine is still busy: {busy}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait; a server that does not stop in time is killed (and that fails)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(
                f"the server did not stop within {timeout_s} s:\n{self.stderr}"
            ) from None
        self._reader.join(10)  # every line it wrote is read
        return code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@contextlib.contextmanager
def tiny_openai_client(tape: str) -> Iterator[Any]:
    """`tokentape serve --model tiny --seed 0` recording on `tape`, and an OpenAI client of
    it (openai.OpenAI); the server is stopped at the end."""
    import openai

    server = ServerProcess("--model", "tiny", "--tape", tape, "--seed", "0")
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        server.stop()
