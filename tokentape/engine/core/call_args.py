"""The arguments of the engine core's calls (pause, sleep, wake_up, weight versions), checked
in plain functions: by AsyncLLM and the server before a call is sent, and by EngineCore before
anything is recorded. A refused argument changes nothing."""

from __future__ import annotations

from collections.abc import Sequence

from tokentape.events import schema as ev
from tokentape.events.validation import check_int, check_str, short_repr, shown

PAUSE_MODES = ("abort", "wait", "keep")
MAX_VERSION_CHARS = 256  # a version is a label (a trainer's step), not a payload


def check_pause_mode(call: str, mode: object) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"{call}: mode must be one of {PAUSE_MODES}, got {mode!r}")


def check_sleep_args(level: object, mode: object) -> None:
    """vLLM's sleep arguments, refused before anything is sent or recorded."""
    check_int("level", level, 0, 2)
    check_pause_mode("sleep", mode)


def check_wake_tags(tags: object) -> list[str] | None:
    """wake_up's tags as a list (None: every tag), each one of schema.WAKE_TAGS."""
    if tags is None:
        return None
    if isinstance(tags, (str, bytes)) or not isinstance(tags, Sequence):
        raise TypeError(f"wake_up: tags must be a list of strings or None, got {shown(tags)}")
    for tag in tags:
        if tag not in ev.WAKE_TAGS:
            raise ValueError(f"wake_up: unknown tag {tag!r}; the tags are {list(ev.WAKE_TAGS)}")
    return list(tags)


def resolve_version(weight_version: object, number: int) -> str:
    """The version an update records: `weight_version` as a string (an int, a trainer's step,
    is taken as its decimal), or the update's number when None. "" is kept as it is (a
    version-3 tape's unnamed update, which the reducer also numbers)."""
    if weight_version is None:
        return str(number)
    if isinstance(weight_version, int) and not isinstance(weight_version, bool):
        return str(weight_version)
    if not isinstance(weight_version, str):
        raise TypeError(
            f"weight_version must be a string, an integer or None, got {shown(weight_version)}"
        )
    check_str("weight_version", weight_version)
    if len(weight_version) > MAX_VERSION_CHARS:
        raise ValueError(
            f"weight_version must be at most {MAX_VERSION_CHARS} characters, "
            f"got {len(weight_version)}: {short_repr(weight_version)}"
        )
    return weight_version
