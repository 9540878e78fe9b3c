"""The FastAPI app of `tokentape serve`: OpenAI's /v1/completions, /v1/chat/completions and
/v1/models; vLLM's /tokenize and /detokenize; /health and /metrics; vLLM's RL endpoints
(rl_endpoints.py) when asked for, and API keys (auth.py). Every error is an OpenAI-style
JSON body ({"error": {"message", "type", "param", "code"}}), and the server keeps serving.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from tokentape.engine.async_llm import AsyncLLM
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.auth import APIKeyMiddleware
from tokentape.entrypoints.chat_template import ChatTemplate
from tokentape.entrypoints.metrics import ServerMetrics
from tokentape.entrypoints.request_body import decode_body
from tokentape.entrypoints.rl_endpoints import RL_PATHS, add_rl_endpoints
from tokentape.entrypoints.serving import APIError, ClientGone, OpenAIServing
from tokentape.entrypoints.serving_chat import create_chat_completion
from tokentape.entrypoints.serving_completion import create_completion
from tokentape.entrypoints.serving_tokenization import (
    detokenize,
    tokenize,
    tokenize_request_type,
)
from tokentape.entrypoints.unsupported_fields import CHAT, COMPLETION, refuse_unsupported
from tokentape.errors import EngineDeadError

logger = logging.getLogger("tokentape.serve")
T = TypeVar("T")
TOKENIZER_PATHS = ("/tokenize", "/detokenize")  # behind the API key, as the /v1 routes
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
    load from."""

    api_keys: tuple[str, ...] = ()
    enable_rl_endpoints: bool = False
    allowed_weight_dirs: tuple[str, ...] = ()


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
        card = p.ModelCard(name, int(time.time()), engine.max_model_len)
        return json_response(p.ModelList([card]))

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
    if options.api_keys:
        app.add_middleware(
            APIKeyMiddleware,
            keys=options.api_keys,
            protected_paths=(*RL_PATHS, *TOKENIZER_PATHS),
            error=unauthorized,
        )
    return app
