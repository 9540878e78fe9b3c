"""`tokentape serve`: the OpenAI-compatible server, with the engine core in a background
process writing the tape.

    tokentape serve --model tiny --tape run.tape --host 127.0.0.1 --port 8000
    python -m tokentape.entrypoints.serve --model oracle --port 0   # any free port

Once listening it prints `serving on http://HOST:PORT` on stderr. SIGTERM or Ctrl-C stops
new work, lets what is in flight finish for --drain-timeout seconds, aborts the rest (on the
tape) and closes the tape, which then verifies (server_lifecycle.py: how it stops, its exit
statuses). Who may call what: API keys (auth.py), the RL endpoints only when asked for
(rl_endpoints.py), and the README's threat model.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokentape.engine.arg_utils import add_engine_cli_args, engine_args_from_cli, int_at_least
from tokentape.entrypoints.server_lifecycle import (
    CORE_STOP_TIMEOUT_S,
    EXIT_ENGINE_FAILED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    StartupError,
    StoppedBeforeServing,
    bind_socket,
    make_server,
    sigterm_stops_startup,
)

if TYPE_CHECKING:
    from tokentape.entrypoints.api_server import ServerOptions

# What `tokentape serve` imports from the `serve` extra (pyproject.toml).
SERVE_MODULES = ("uvicorn", "fastapi", "zmq", "prometheus_client")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `serve` on the CLI's subparsers."""
    from tokentape.entrypoints.cli.common import add_force_argument

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
            '{"abort_all": true}). With an API key (--api-key, or the TOKENTAPE_API_KEY or\n'
            "VLLM_API_KEY environment variable) every /v1 route and RL endpoint needs\n"
            "'Authorization: Bearer KEY'. The engine core runs in a background process and\n"
            "records every request, abort, pause and sleep on the tape. Prints 'serving on\n"
            "http://HOST:PORT' on stderr once listening. SIGTERM or Ctrl-C: stop taking\n"
            "requests, let those in flight finish for --drain-timeout seconds, abort the rest\n"
            "(on the tape), close the tape.\n"
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
    tape = srv.add_mutually_exclusive_group()
    tape.add_argument(
        "--tape",
        metavar="PATH",
        default=None,
        help="tape file to create; an existing file is refused unless --force "
        "(default: tokentape-serve-<UTC timestamp>.tape in the current directory)",
    )
    tape.add_argument("--no-tape", action="store_true", help="do not write a tape file")
    add_force_argument(srv, "tape file")
    add_engine_cli_args(  # --model, --seed, --sync and the engine's flags (arg_utils.py)
        srv,
        help_overrides={
            "cpu_threads": "default: one per CPU less one, left to the HTTP server, at least "
            "one; one per CPU with --in-process"
        },
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
    srv.set_defaults(func=cmd_serve)
    return srv


def server_cpu_threads() -> int:
    """The engine core's lanes beside the HTTP server: one per CPU less one, which the server's
    event loop needs for every streamed token (as vLLM's CPU backend reserves one for its
    frontend processes). Measured on 2 cores (bench_serve, alternating): with two lanes beside
    the server the core spent 234-256 us of CPU per output token, with one 176-193, and serving
    cost 13% and 23% of generate's throughput against -9% and 2% in the quieter of two batches
    (docs/benchmarks.md, Serving)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _default_tape_path() -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path, n = f"tokentape-serve-{stamp}.tape", 1
    while os.path.exists(path):
        n += 1
        path = f"tokentape-serve-{stamp}-{n}.tape"
    return path


def server_options(args: argparse.Namespace) -> ServerOptions:
    """Who may call what, from the flags and the environment."""
    from tokentape.entrypoints.api_server import ServerOptions
    from tokentape.entrypoints.auth import api_keys_from
    from tokentape.entrypoints.rl_endpoints import dev_mode

    for folder in args.allowed_weight_dirs:
        if not os.path.isdir(folder):
            raise StartupError(f"--allowed-weight-dirs: {folder} is not a directory")
    return ServerOptions(
        api_keys=tuple(api_keys_from(args.api_key)),
        enable_rl_endpoints=args.enable_rl_endpoints or dev_mode(),
        allowed_weight_dirs=tuple(args.allowed_weight_dirs),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from tokentape.extras import require_extra

    # One line naming the extra, exit 2, before anything starts (a traceback otherwise).
    require_extra("serve", "tokentape serve", *SERVE_MODULES)
    import uvicorn

    from tokentape.engine.async_llm import AsyncLLM
    from tokentape.engine.config import EngineConfig
    from tokentape.entrypoints.api_server import build_app
    from tokentape.entrypoints.cli.common import check_output_path, remove_for_overwrite

    options = server_options(args)
    tape: str | None = None if args.no_tape else (args.tape or _default_tape_path())
    if args.tape is not None and check_output_path(args.tape, args.force, "--tape"):
        # Bad arguments fail before the removal.
        EngineConfig(model=args.model, **engine_args_from_cli(args))
        remove_for_overwrite(args.tape)
    kwargs = engine_args_from_cli(args)
    if args.cpu_threads is None and not args.in_process:
        kwargs["cpu_threads"] = server_cpu_threads()
    sock = bind_socket(args.host, args.port)  # a port in use fails before the engine is built
    try:
        with sigterm_stops_startup():
            engine = AsyncLLM(
                args.model,
                tape=tape,
                multiprocess_mode=not args.in_process,
                stream_interval=args.stream_interval,
                **kwargs,
            )
    except StoppedBeforeServing:
        sock.close()
        return EXIT_OK
    except BaseException:
        sock.close()
        raise

    def close_engine() -> None:
        engine.shutdown(CORE_STOP_TIMEOUT_S)  # aborts what is left (on the tape), closes it
        if engine.tape_path:
            print(f"tape: {engine.tape_path}", file=sys.stderr, flush=True)

    try:
        app = build_app(engine, args.served_model_name, options=options)
        config = uvicorn.Config(app, log_level=args.log_level, lifespan="off")
        server = make_server(config, args.drain_timeout, engine.abort_all, close_engine)
        # A core that fails while serving: stop as SIGTERM does (open streams have ended with
        # an error event), then exit 1.
        engine.failure_callbacks.append(lambda reason: setattr(server, "should_exit", True))
        # The engine closes inside uvicorn's shutdown, after the connections are drained (or
        # their requests aborted). uvicorn's own loop (uvloop when installed).
        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
            runner.run(server.serve(sockets=[sock]))
    finally:
        engine.shutdown(CORE_STOP_TIMEOUT_S)  # a no-op when the server closed it
        sock.close()
    if engine.failure is not None:
        print(
            f"error: the engine core failed while serving: {engine.failure}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_ENGINE_FAILED
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokentape")
    sub = parser.add_subparsers(dest="command")
    srv = add_parser(sub)
    try:
        args = srv.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    from tokentape.entrypoints.cli.common import CLIError

    try:
        return cmd_serve(args)
    except (CLIError, StartupError, ValueError, TypeError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
