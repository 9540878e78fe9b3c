"""The OpenAI-compatible server: its FastAPI app and `run_server`, which runs it (as vLLM's
`vllm/entrypoints/openai/api_server.py`).

The app (build_app): OpenAI's /v1/completions, /v1/chat/completions and /v1/models; vLLM's
/tokenize and /detokenize and its tokens-in, tokens-out /inference/v1/generate
(serving_tokens.py); /health and /metrics; vLLM's RL endpoints (rl_endpoints.py) when
asked for, and API keys (auth.py). Every error is an OpenAI-style JSON body
({"error": {"message", "type", "param", "code"}}), and the server keeps serving.

run_server binds the socket, builds the AsyncLLM (its engine core in a background process
writing the tape) and the app, and serves it on uvicorn until SIGTERM, Ctrl-C or a failed
engine core (launcher.py: how it starts and stops, its exit statuses). `tokentape serve`
(cli/serve.py) calls it; so does this module run as a program, with the same arguments
(cli_args.py):

    python -m tokentape.entrypoints.api_server --model oracle --port 0   # any free port
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from tokentape.engine.arg_utils import UsageContext, engine_args_from_cli
from tokentape.engine.async_llm import AsyncLLM
from tokentape.engine.config import EngineConfig
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.auth import APIKeyMiddleware, api_keys_from
from tokentape.entrypoints.chat_template import ChatTemplate
from tokentape.entrypoints.cli.common import (
    CLIError,
    check_output_path,
    flight_recorder_spec,
    remove_for_overwrite,
    timestamped_tape_path,
)
from tokentape.entrypoints.cli_args import make_arg_parser
from tokentape.entrypoints.launcher import (
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
from tokentape.entrypoints.lora_endpoints import add_lora_endpoints, runtime_lora_updating
from tokentape.entrypoints.metrics import ServerMetrics
from tokentape.entrypoints.request_body import decode_body
from tokentape.entrypoints.rl_endpoints import (
    COLLECTIVE_RPC_PATH,
    RL_PATHS,
    add_collective_rpc_endpoint,
    add_rl_endpoints,
    dev_mode,
)
from tokentape.entrypoints.serving_chat import create_chat_completion
from tokentape.entrypoints.serving_completion import create_completion
from tokentape.entrypoints.serving_engine import APIError, ClientGone, OpenAIServing
from tokentape.entrypoints.serving_tokenization import (
    detokenize,
    tokenize,
    tokenize_request_type,
)
from tokentape.entrypoints.serving_tokens import generate_tokens
from tokentape.entrypoints.unsupported_fields import (
    CHAT,
    COMPLETION,
    GENERATE,
    GENERATE_SAMPLING,
    refuse_unsupported,
    refuse_unsupported_in,
)
from tokentape.errors import EngineDeadError, LoRAError
from tokentape.events.tape_path import TapeSpec, check_tape_path

logger = logging.getLogger("tokentape.serve")
T = TypeVar("T")
# Behind the API key, as the /v1 routes: the tokenizer's and vLLM's tokens-in, tokens-out
# endpoint (vLLM leaves these open; here a key guards every route that runs the model).
TOKENIZER_PATHS = ("/tokenize", "/detokenize")
GENERATE_PATH = "/inference/v1/generate"
CLIENT_CLOSED = 499  # nginx's status for a client that went away; nobody reads it


def json_response(body: object, status: int = 200) -> Response:
    return Response(p.encode_json(body), status_code=status, media_type="application/json")


def error_response(status: int, message: str, type: str, param: str | None = None) -> Response:
    return json_response(p.ErrorResponse(p.ErrorInfo(message, type, param, status)), status)


async def read_body(request: Request, body_type: type[T]) -> T:
    """The JSON body as `body_type` (request_body.decode_body: 400 or 422 with its field)."""
    return decode_body(await request.body(), body_type)


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """Who may call what (README, "Serve": the threat model). `api_keys`: a Bearer token
    one of them for every /v1 route and RL endpoint (none: no key asked for);
    `enable_rl_endpoints`: serve the RL endpoints (rl_endpoints.RL_PATHS: pause, resume,
    reset, weights, sleep mode, abort); `allowed_weight_dirs`: the folders /update_weights may
    load from; `enable_collective_rpc`: serve POST /collective_rpc (dev mode)."""

    api_keys: tuple[str, ...] = ()
    enable_rl_endpoints: bool = False
    allowed_weight_dirs: tuple[str, ...] = ()
    # POST /collective_rpc runs worker code the caller names: vLLM serves it in dev mode only
    # (VLLM_SERVER_DEV_MODE=1), and so does tokentape.
    enable_collective_rpc: bool = False
    # The LoRA adapters served by name from the start (--lora-modules: name -> folder), and
    # whether /v1/load_lora_adapter and /v1/unload_lora_adapter are served
    # (VLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM gates them).
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_runtime_lora: bool = False


def build_app(
    engine: AsyncLLM,
    model_name: str | None = None,
    chat_template: ChatTemplate | None = None,
    options: ServerOptions | None = None,
) -> FastAPI:
    """The app over a started AsyncLLM. The caller owns the engine (and shuts it down)."""
    options = options or ServerOptions()
    name = model_name or engine.model
    metrics = ServerMetrics(name, lambda: engine.stats)
    serving = OpenAIServing(
        engine, name, chat_template or ChatTemplate.for_model(engine.model), metrics
    )
    app = FastAPI(title="tokentape", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    for lora_name, lora_path in options.lora_modules:
        serving.add_lora_module(lora_name, lora_path)  # loaded by its first request

    def error(status: int, message: str, type: str, param: str | None = None) -> Response:
        metrics.errors.labels(status=str(status)).inc()
        return error_response(status, message, type, param)

    def unauthorized() -> Response:
        return error(
            401,
            "Unauthorized: this route needs a valid API key (Authorization: Bearer <key>)",
            "AuthenticationError",
        )

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return error(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ())]
        return error(
            422,
            f"{'.'.join(loc)}: {first.get('msg', 'invalid')}",
            "invalid_request_error",
            loc[-1] if loc else None,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        detail = f"{request.method} {request.url.path}: {exc.detail}"
        return error(exc.status_code, detail, kind)

    @app.exception_handler(EngineDeadError)
    async def dead(request: Request, exc: EngineDeadError) -> Response:
        return error(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        logger.exception("internal error on %s", request.url.path)
        return error(500, f"{type(exc).__name__}: {exc}", "InternalServerError")

    # -- OpenAI ----------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.body()
        req = decode_body(body, p.CompletionRequest)
        refuse_unsupported(body, COMPLETION)
        try:
            return await create_completion(serving, req, request)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await request.body()
        req = decode_body(body, p.ChatCompletionRequest)
        refuse_unsupported(body, CHAT)
        try:
            return await create_chat_completion(serving, req, request)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    @app.post(GENERATE_PATH)
    async def generate_tokens_endpoint(request: Request) -> Response:
        body = await request.body()
        req = decode_body(body, p.GenerateRequest)
        refuse_unsupported(body, GENERATE)
        refuse_unsupported_in(body, "sampling_params", GENERATE_SAMPLING)
        try:
            return await generate_tokens(serving, req, request)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    @app.post("/tokenize")
    async def tokenize_endpoint(request: Request) -> Response:
        body = await request.body()
        return json_response(tokenize(serving, decode_body(body, tokenize_request_type(body))))

    @app.post("/detokenize")
    async def detokenize_endpoint(request: Request) -> Response:
        req = await read_body(request, p.DetokenizeRequest)
        return json_response(detokenize(serving, req))

    @app.get("/v1/models")
    async def models() -> Response:
        created = int(time.time())
        cards = [p.ModelCard(name, created, engine.max_model_len)]
        cards += [
            p.ModelCard(
                lora.lora_name, created, engine.max_model_len, root=lora.lora_path, parent=name
            )
            for lora in serving.lora_requests.values()
        ]
        return json_response(p.ModelList(cards))

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return error(503, "the engine is not serving", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if options.enable_rl_endpoints:
        add_rl_endpoints(app, engine, options.allowed_weight_dirs, json_response)
    if options.enable_collective_rpc:
        add_collective_rpc_endpoint(app, engine, json_response)
    if options.enable_runtime_lora:
        add_lora_endpoints(app, engine, serving, json_response)
    if options.api_keys:
        app.add_middleware(
            APIKeyMiddleware,
            keys=options.api_keys,
            protected_paths=(*RL_PATHS, COLLECTIVE_RPC_PATH, *TOKENIZER_PATHS, GENERATE_PATH),
            error=unauthorized,
        )
    return app


# -- running the server ------------------------------------------------------------------------


def server_options(args: argparse.Namespace) -> ServerOptions:
    """Who may call what, from the flags and the environment."""
    for folder in args.allowed_weight_dirs:
        if not os.path.isdir(folder):
            raise StartupError(f"--allowed-weight-dirs: {folder} is not a directory")
    check_lora_modules(args)
    return ServerOptions(
        api_keys=tuple(api_keys_from(args.api_key)),
        enable_rl_endpoints=args.enable_rl_endpoints or dev_mode(),
        enable_collective_rpc=dev_mode(),
        allowed_weight_dirs=tuple(args.allowed_weight_dirs),
        lora_modules=tuple(args.lora_modules),
        enable_runtime_lora=runtime_lora_updating(),
    )


def check_lora_modules(args: argparse.Namespace) -> None:
    """--lora-modules, read and checked before the engine is built (their shapes against the
    model when the first request loads them)."""
    if not args.lora_modules:
        return
    if not args.enable_lora:
        raise StartupError("--lora-modules needs --enable-lora")
    names = [name for name, _ in args.lora_modules]
    if len(set(names)) < len(names) or args.served_model_name in names:
        raise StartupError(f"--lora-modules: every name must be unique, got {', '.join(names)}")
    from tokentape.lora.peft_adapter import load_peft_adapter

    max_rank = args.max_lora_rank or EngineConfig().max_lora_rank
    for name, path in args.lora_modules:
        try:
            load_peft_adapter(path, max_rank)
        except LoRAError as exc:
            raise StartupError(f"--lora-modules {name}: {exc}") from None


def run_server(args: argparse.Namespace) -> int:
    """Serve until stopped, from the parsed arguments (cli_args.py); the exit status."""
    import uvicorn

    options = server_options(args)
    tape: TapeSpec
    if args.tape_dir is not None:
        tape = flight_recorder_spec(args)
        try:
            check_tape_path(tape)  # a read-only or full file system: before the engine is built
        except OSError as exc:
            raise StartupError(str(exc)) from None
    else:
        tape = None if args.no_tape else (args.tape or timestamped_tape_path("tokentape-serve"))
    kwargs = engine_args_from_cli(args)
    if args.tape is not None and check_output_path(args.tape, args.force, "--tape"):
        EngineConfig(model=args.model, **kwargs)  # bad arguments fail before the removal
        remove_for_overwrite(args.tape)
    sock = bind_socket(args.host, args.port)  # a port in use fails before the engine is built
    try:
        with sigterm_stops_startup():
            engine = AsyncLLM(
                args.model,
                tape=tape,
                multiprocess_mode=not args.in_process,
                stream_interval=args.stream_interval,
                usage_context=UsageContext.OPENAI_API_SERVER,
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
    """The server run as a program: `tokentape serve`'s arguments, errors and exit statuses."""
    parser = make_arg_parser(
        argparse.ArgumentParser(
            prog="python -m tokentape.entrypoints.api_server",
            description="tokentape's OpenAI-compatible server, as `tokentape serve` (whose "
            "--help says what it serves, how it stops and its exit statuses).",
        )
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    try:
        return run_server(args)
    except (CLIError, StartupError, ValueError, TypeError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
