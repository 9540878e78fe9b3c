"""Errors of the event-sourced core that are not about reading a file (see store.TapeError)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokentape.errors import ReducerError

if TYPE_CHECKING:
    from tokentape.events.schema import Event


# What applying an event to a state it cannot follow raises: the reducer's own checks raise
# ReducerError, and a damaged or hand-edited event can also trip a lookup, a conversion or an
# arithmetic limit (a negative token id where bytes are built, an integer too large).
FOLD_ERRORS: tuple[type[Exception], ...] = (
    ReducerError,
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    ArithmeticError,
)


def event_refused(seq: int, event: Event, exc: BaseException) -> ReducerError:
    """The one report of a fold that fails: the event's position, kind and step, and why."""
    from tokentape.events.schema import kind_of

    return ReducerError(
        f"event {seq} ({kind_of(event)} of step {event.step}) cannot be applied to the state "
        f"before it: {one_line(exc)}"
    )


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (a KeyError's without its quotes)."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return " ".join(text.split()) or type(exc).__name__
