"""Tape stores: where events go. One interface, three stores.

- `SQLiteTape` (tokentape.events.sqlite_store): the default, a file that survives the process.
- `MemoryTape`: the same bytes kept in a list, for tests and `tape=None`.
- `NullTape`: records nothing; only for measuring what the tape itself costs.

Writers `append` events and `commit` at every step boundary. Readers stream `(seq, event)`
pairs in order without loading the whole tape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import msgspec

from tokentape.errors import TapeError, TapeFormatError
from tokentape.events import schema as ev


class TapeWriter(Protocol):
    path: str | None
    header: ev.TapeHeader

    def append(self, event: ev.Event) -> None: ...

    def commit(self) -> None:
        """Mark a step boundary: what was appended so far becomes one transaction."""

    def flush(self) -> None:
        """Commit, and return once everything committed is stored."""

    def close(self) -> None: ...


@runtime_checkable
class TakesSnapshots(Protocol):
    """A writer whose segments open with a snapshot of the engine (the segmented tape): the
    engine hands it the way to take one, `take(segment, seq_offset)`, when it is built."""

    def bind_snapshots(self, take: Callable[[int, int], ev.EngineSnapshot]) -> None: ...


class TapeReader(Protocol):
    path: str | None
    header: ev.TapeHeader

    def iter_events(self, start: int = 0) -> Iterator[tuple[int, ev.Event]]: ...

    def __len__(self) -> int: ...


def check_format_version(version: int, path: str | None) -> None:
    if version > ev.FORMAT_VERSION:
        raise TapeFormatError(
            path,
            f"tape format version {version} is newer than this tokentape reads "
            f"(up to {ev.FORMAT_VERSION}); upgrade tokentape to read it",
        )


def decode_at(data: object, seq: int, path: str | None) -> ev.Event:
    """The event stored at `seq`, or a TapeError naming it: `data` comes from a file that may
    have been damaged or edited, so it may be NULL, text or a number instead of a blob."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        what = "NULL" if data is None else f"{type(data).__name__} {str(data)[:40]!r}"
        raise TapeError(path, f"event data is {what}, not an encoded event", seq)
    try:
        return ev.decode(data)
    except msgspec.DecodeError as exc:
        raise TapeError(path, f"event cannot be decoded ({exc})", seq) from None


class MemoryTape:
    """A tape held in memory as encoded events, so it reads back exactly like a file."""

    path: str | None = None

    def __init__(self, header: ev.TapeHeader) -> None:
        self.header = header
        self._rows: list[bytes] = []

    def append(self, event: ev.Event) -> None:
        self._rows.append(ev.encode(event))

    def commit(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        return len(self._rows)

    def iter_events(self, start: int = 0) -> Iterator[tuple[int, ev.Event]]:
        for seq in range(start, len(self._rows)):
            yield seq, decode_at(self._rows[seq], seq, None)


class NullTape:
    """Keeps nothing. Benchmarks use it to measure the engine with the tape off."""

    path: str | None = None

    def __init__(self, header: ev.TapeHeader) -> None:
        self.header = header

    def append(self, event: ev.Event) -> None:
        pass

    def commit(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
