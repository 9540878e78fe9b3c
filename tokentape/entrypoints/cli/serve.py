"""`tokentape serve`: the OpenAI-compatible server, with the engine core in a background
process writing the tape. Its arguments are in tokentape/entrypoints/cli_args.py; what runs
the server is `run_server` in tokentape/entrypoints/api_server.py.

    tokentape serve --model tiny --tape run.tape --host 127.0.0.1 --port 8000
    tokentape serve --model oracle --port 0 --no-tape   # any free port

Once listening it prints `serving on http://HOST:PORT` on stderr. SIGTERM or Ctrl-C stops
new work, lets what is in flight finish for --drain-timeout seconds, aborts the rest (on the
tape) and closes the tape, which then verifies (launcher.py: how it stops, its exit
statuses). Who may call what: API keys (auth.py), the RL endpoints only when asked for
(rl_endpoints.py), and the README's threat model.
"""

from __future__ import annotations

import argparse
from typing import Any

from tokentape.entrypoints.cli_args import make_arg_parser

# What `tokentape serve` imports from the `serve` extra (pyproject.toml).
SERVE_MODULES = ("uvicorn", "fastapi", "zmq", "prometheus_client")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `serve` on the CLI's subparsers."""
    srv = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API (and vLLM's pause/resume endpoints), recording a tape",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Serve the engine over HTTP: /v1/completions (a string or token-id prompt; SSE with\n"
            "stream), /v1/chat/completions (the checkpoint's chat template; a simple built-in one\n"
            "for the built-in models and the oracle), /v1/models, /health, /metrics (Prometheus),\n"
            "and, with --enable-rl-endpoints (or VLLM_SERVER_DEV_MODE=1), vLLM's RL endpoints:\n"
            "POST /pause?mode=abort|wait|keep&clear_cache=true|false, POST /resume, GET\n"
            '/is_paused, POST /reset_prefix_cache, POST /update_weights (JSON {"path": FOLDER},\n'
            'a folder under --allowed-weight-dirs; optional "weight_version"), the chunked\n'
            "transfer POST /start_weight_update, /update_weights per chunk, POST\n"
            "/finish_weight_update, and GET /weight_info; sleep mode's POST\n"
            "/sleep?level=0|1|2&mode=M, POST /wake_up[?tags=weights&tags=kv_cache], GET\n"
            '/is_sleeping; and SGLang\'s POST /abort_request (JSON {"rid": ID} or\n'
            '{"abort_all": true}). With --enable-lora, --lora-modules NAME=PATH serves LoRA\n'
            "adapters: a request whose model is NAME runs with it; with\n"
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, POST /v1/load_lora_adapter and\n"
            "/v1/unload_lora_adapter load and unload them. With an API key (--api-key, or the\n"
            "TOKENTAPE_API_KEY or VLLM_API_KEY environment variable) every /v1 route and RL\n"
            "endpoint needs 'Authorization: Bearer KEY'. The engine core runs in a background\n"
            "process and records every request, abort, pause, sleep and LoRA adapter on the\n"
            "tape. Prints 'serving on http://HOST:PORT' on stderr once listening. SIGTERM or\n"
            "Ctrl-C: stop taking requests, let those in flight finish for --drain-timeout\n"
            "seconds, abort the rest (on the tape), close the tape.\n"
            "\n"
            "exit status: 0 when stopped by SIGTERM (the tape closed), 1 when the engine core\n"
            "failed while serving (open streams end with an error event; the server drains and\n"
            "stops), 2 when it cannot start (bad arguments, a port in use, a model that does not\n"
            "load), 130 on Ctrl-C."
        ),
        epilog=(
            "examples:\n"
            "  tokentape serve --model tiny --tape run.tape --port 8000\n"
            "  tokentape serve --model oracle --port 0 --no-tape\n"
            "  TOKENTAPE_API_KEY=secret tokentape serve --enable-rl-endpoints \\\n"
            "      --allowed-weight-dirs /ckpt\n"
            "  curl -X POST -H 'Authorization: Bearer secret' \\\n"
            "      'localhost:8000/pause?mode=keep&clear_cache=true'"
        ),
    )
    make_arg_parser(srv)
    srv.set_defaults(func=cmd_serve)
    return srv


def cmd_serve(args: argparse.Namespace) -> int:
    from tokentape.extras import require_extra

    # One line naming the extra, exit 2, before anything starts (a traceback otherwise).
    require_extra("serve", "tokentape serve", *SERVE_MODULES)
    from tokentape.entrypoints.api_server import run_server

    return run_server(args)
