"""The loop every side script runs: one JSON request per line on stdin, one JSON reply per
line on a private pipe.

The reply pipe is the process's original stdout, moved to a fresh descriptor before anything
else runs; descriptor 1 then points at stderr, so that libraries that log to stdout (vLLM
does) and the child processes they start cannot break the protocol. Replies are
`{"ok": true, ...}` or `{"ok": false, "error": "<traceback>"}`; the first is the `ready`
reply after setup. Stdlib only.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

Handler = Callable[[dict[str, Any]], dict[str, Any]]
Setup = Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Handler]]]


def _reply_channel() -> Any:
    sys.stdout.flush()
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # from here on, anything written to stdout lands in the log
    return channel


def run(setup: Setup) -> int:
    """Read the spec (JSON file named by argv[1]), call `setup(spec)` -> (ready info,
    handlers by command name), reply `ready`, then serve commands until `quit` or EOF."""
    channel = _reply_channel()

    def send(reply: dict[str, Any]) -> None:
        channel.write(json.dumps(reply) + "\n")

    try:
        with open(sys.argv[1]) as f:
            spec = json.load(f)
        info, handlers = setup(spec)
    except BaseException:
        send({"ok": False, "error": traceback.format_exc()})
        return 1
    send({"ok": True, "ready": info})
    for line in sys.stdin:
        request = json.loads(line)
        cmd = request.pop("cmd")
        if cmd == "quit":
            break
        try:
            send({"ok": True, **handlers[cmd](request)})
        except BaseException:
            send({"ok": False, "error": traceback.format_exc()})
    send({"ok": True, "bye": True})
    return 0
