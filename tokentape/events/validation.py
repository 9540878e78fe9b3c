"""Checks for values that go on the tape, with one style of message: `NAME must be ..., got ...`.

msgpack holds 64-bit integers and msgspec decodes strictly (a bool is not an int, an int is not
a bool), so a value the tape could not hold or read back must be refused where it enters the
engine, before anything is recorded. A wrong type raises TypeError, a bad value ValueError.
"""

from __future__ import annotations

import math

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


def short_repr(value: object) -> str:
    """A value's repr cut short, for an error message (a prompt or an int may be huge)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def shown(value: object) -> str:
    """A value of the wrong type for an error message: its type and its short repr."""
    return f"{type(value).__name__} {short_repr(value)}"


def check_int(
    name: str, value: object, lo: int = INT64_MIN, hi: int = INT64_MAX, *, optional: bool = False
) -> None:
    """An int (never a bool) in [lo, hi]; hi defaults to what the tape can hold."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an integer{' or None' if optional else ''}, got {shown(value)}"
        )
    if not lo <= value <= hi:
        if lo == INT64_MIN and hi == INT64_MAX:
            wanted = "a 64-bit signed integer"
        elif hi == INT64_MAX:
            wanted = f"an integer >= {lo} (and < 2**63)"
        else:
            wanted = f"in {lo}..{hi}"
        raise ValueError(
            f"{name} must be {wanted}{' or None' if optional else ''}, got {short_repr(value)}"
        )


def check_number(
    name: str, value: object, lo: float, hi: float = math.inf, *, lo_open: bool = False
) -> float:
    """A finite int or float (never a bool) in [lo, hi], or (lo, hi] with lo_open; as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    low_ok = number > lo if lo_open else number >= lo
    if not (math.isfinite(number) and low_ok and number <= hi):
        bound = f"> {lo}" if lo_open else f">= {lo}"
        wanted = (
            f"a finite number {bound}"
            if hi == math.inf
            else f"a number in {'(' if lo_open else '['}{lo}, {hi}]"
        )
        raise ValueError(f"{name} must be {wanted}, got {short_repr(value)}")
    return number


def check_bool(name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, bool):
        raise TypeError(
            f"{name} must be True or False{' or None' if optional else ''}, got {shown(value)}"
        )


def check_str(name: str, value: object) -> None:
    """A string that encodes as UTF-8 (msgpack's strings are UTF-8; a lone surrogate is not)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {shown(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} must be valid Unicode text (UTF-8), got {short_repr(value)}: "
            f"{exc.reason} at position {exc.start}"
        ) from None
