"""Optional extras: a feature whose modules are not installed stops with one line naming the
extra to install, not with an import traceback from deep inside."""

from __future__ import annotations

import importlib
import sys

EXIT_MISSING_EXTRA = 2  # the CLI's status for an error the user can fix


class MissingExtra(SystemExit):
    """An optional extra is not installed. A SystemExit with status 2 (so a script that does
    not catch it ends with the one line already printed, no traceback); catch it to go on."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_MISSING_EXTRA)
        self.message = message

    def __str__(self) -> str:
        return self.message


def require_extra(extra: str, what: str, *modules: str) -> None:
    """Import each module (a real import: a broken install fails too); if one fails, print
    one line on stderr naming the extra and raise MissingExtra."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing = exc.name or name
            message = (
                f"error: {what} needs the '{extra}' extra ({missing} is not installed): "
                f"pip install 'tokentape[{extra}]'"
            )
            print(message, file=sys.stderr, flush=True)
            raise MissingExtra(message) from None
