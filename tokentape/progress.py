"""Progress bars on stderr, drawn with rich, as vLLM's `use_tqdm` draws them with tqdm.

A bar is drawn only when its stream (stderr) is a terminal: piped or captured output gets
nothing, so scripts and JSON consumers see exactly what they did before. A bar is redrawn at
most every REFRESH_S seconds and draws nothing between updates (no refresh thread), so a
loop that reports every step pays one clock read per step.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

REFRESH_S = 0.2  # the most often a bar is redrawn


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _bar(stream: TextIO, *columns: Any, transient: bool) -> Any:
    from rich.console import Console
    from rich.progress import Progress

    return Progress(*columns, console=Console(file=stream), transient=transient, auto_refresh=False)


@contextlib.contextmanager
def progress(
    total: int | None, description: str, stream: TextIO | None = None, minimum: int = 200_000
) -> Iterator[Callable[[int], None]]:
    """A bar for a long read of a tape: at least `minimum` events (`total` None when the
    length is unknown, as in a damaged tape), on a terminal. Yields `update(done)`, a no-op
    when no bar is drawn."""
    stream = stream if stream is not None else sys.stderr
    if (total is not None and total < minimum) or not is_terminal(stream):
        yield lambda done: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

    with _bar(
        stream,
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        last = time.monotonic()

        def update(done: int) -> None:
            nonlocal last
            now = time.monotonic()
            if now - last >= REFRESH_S:
                last = now
                bar.update(task, completed=done, refresh=True)

        bar.refresh()
        yield update


class RequestProgress:
    """vLLM's "Processed prompts" bar over a batch of requests: how many have finished, and
    the output tokens per second so far. `update` is cheap between redraws; the token count is
    asked for (a callable) only when the bar is redrawn."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        stream = stream if stream is not None else sys.stderr
        self._bar: Any = None
        if not enabled or total <= 0 or not is_terminal(stream):
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

        self._bar = _bar(
            stream,
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[speed]}"),
            transient=False,
        )
        self._task = self._bar.add_task("Processed prompts", total=total, speed="")
        self._start = self._last = time.monotonic()
        self._bar.start()

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def update(self, finished: int, output_tokens: Callable[[], int], force: bool = False) -> None:
        if self._bar is None:
            return
        now = time.monotonic()
        if not force and now - self._last < REFRESH_S:
            return
        self._last = now
        tokens = output_tokens()
        speed = f"output: {tokens / max(now - self._start, 1e-9):,.1f} toks/s ({tokens:,} tokens)"
        self._bar.update(self._task, completed=finished, speed=speed, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> RequestProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


LOUD_BYTES = 64 << 20  # a model's weights past this take seconds to build, load or prepare


def say(message: str, stream: TextIO | None = None) -> None:
    """One line on stderr before a phase that takes seconds (building a large model's weights,
    loading a checkpoint, allocating the KV cache), so a slow start is never silent."""
    print(f"{message}...", file=stream or sys.stderr, flush=True)


def gigabytes(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.1f} GB"
