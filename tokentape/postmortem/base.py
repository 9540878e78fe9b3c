"""The checker interface: hooks called before and after the reducer applies an event."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokentape.postmortem.context import Context

Hook = Callable[[int, Any], None]  # (seq, event)


class Checker:
    """A checker reads the state the reducer derives (never writes it) around the events it
    names in `before` and `after`; `finish` runs once after the readable prefix of the tape."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.state = ctx.state

    def before(self) -> dict[type, Hook]:
        return {}

    def after(self) -> dict[type, Hook]:
        return {}

    def finish(self) -> None:
        pass
