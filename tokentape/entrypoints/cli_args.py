"""The OpenAI-compatible server's arguments, as vLLM's `make_arg_parser`: `tokentape serve`
(cli/serve.py) and `python -m tokentape.entrypoints.api_server` parse the same ones. The
engine's own flags are defined in tokentape/engine/arg_utils.py.
"""

from __future__ import annotations

import argparse
from typing import Any

from tokentape.engine.arg_utils import add_engine_cli_args, int_at_least
from tokentape.entrypoints.cli.common import add_tape_arguments


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def lora_module(text: str) -> tuple[str, str]:
    """An argparse type: NAME=PATH, as vLLM's --lora-modules takes it."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def make_arg_parser(srv: Any) -> Any:
    """Add the server's arguments to `srv` (an argparse parser) and return it."""
    srv.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients use (default: --model)",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    srv.add_argument(
        "--port",
        type=int_at_least(0),
        default=8000,
        help="port to bind; 0 picks a free one (default: 8000)",
    )
    add_tape_arguments(srv, "tokentape-serve", flight_recorder=True)
    add_engine_cli_args(srv, server=True)  # --model, --seed, --sync, the engine's flags
    srv.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served under their names, with --enable-lora: a "
        "request whose model is NAME runs with that adapter (vLLM's option; default: none)",
    )
    srv.add_argument(
        "--stream-interval",
        type=int_at_least(1),
        default=1,
        metavar="N",
        help="tokens per streamed chunk after a stream's first (vLLM's option): N > 1 "
        "sends fewer, larger chunks, so serving costs less CPU per token, and tokens "
        "arrive up to N - 1 steps later (default: 1)",
    )
    srv.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every /v1 route and RL endpoint "
        "(default: the TOKENTAPE_API_KEY environment variable, else VLLM_API_KEY; "
        "prefer them: a command line is visible to every user of the machine)",
    )
    srv.add_argument(
        "--enable-rl-endpoints",
        action="store_true",
        help="serve vLLM's RL endpoints (/pause, /resume, /is_paused, "
        "/reset_prefix_cache, /update_weights, /start_weight_update, /finish_weight_update, "
        "/weight_info, /sleep, /wake_up, /is_sleeping, and SGLang's /abort_request), which "
        "change what every client gets; "
        "also on with VLLM_SERVER_DEV_MODE=1 (default: off)",
    )
    srv.add_argument(
        "--allowed-weight-dirs",
        nargs="+",
        default=[],
        metavar="DIR",
        help="the folders /update_weights may load checkpoints from (their "
        "subfolders too); any other path is refused (default: none)",
    )
    srv.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=10.0,
        metavar="S",
        help="on SIGTERM, seconds to let requests in flight finish before they are "
        "aborted (default: 10)",
    )
    srv.add_argument(
        "--in-process",
        action="store_true",
        help="step the engine inside the server's event loop instead of a background "
        "process (for debugging)",
    )
    srv.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default: warning)",
    )
    return srv
