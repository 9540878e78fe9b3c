"""Errors of the event-sourced core that are not about reading a file (see store.TapeError)."""


class ReducerError(RuntimeError):
    """An event that cannot follow the state it is applied to: the tape is inconsistent."""
