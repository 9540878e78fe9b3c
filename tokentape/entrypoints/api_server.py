"""The FastAPI app of `tokentape serve`: OpenAI's /v1/completions, /v1/chat/completions and
/v1/models; /health and /metrics; vLLM's RL endpoints by vLLM's names (/pause, /resume,
/is_paused, /reset_prefix_cache, /update_weights). Every error is an OpenAI-style JSON body
({"error": {"message", "type", "param", "code"}}), and the server keeps serving.
"""

from __future__ import annotations

import logging
import time
from typing import Literal, TypeVar

import msgspec
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from tokentape.engine.async_llm import AsyncLLM
from tokentape.engine.llm_engine import EngineDeadError
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.chat_template import ChatTemplate
from tokentape.entrypoints.metrics import ServerMetrics
from tokentape.entrypoints.serving import APIError, ClientGone, OpenAIServing
from tokentape.entrypoints.serving_chat import create_chat_completion
from tokentape.entrypoints.serving_completion import create_completion

logger = logging.getLogger("tokentape.serve")
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a client that went away; nobody reads it


def json_response(body: object, status: int = 200) -> Response:
    return Response(p.encode_json(body), status_code=status, media_type="application/json")


def error_response(status: int, message: str, type: str, param: str | None = None) -> Response:
    return json_response(p.ErrorResponse(p.ErrorInfo(message, type, param, status)), status)


async def read_body(request: Request, body_type: type[T]) -> T:
    """The JSON body as `body_type`: malformed JSON is a 400, a body of the wrong shape a 422."""
    data = await request.body()
    try:
        return msgspec.json.decode(data, type=body_type)
    except msgspec.ValidationError as exc:
        raise APIError(422, f"invalid request body: {exc}", param=_param_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


def _param_of(message: str) -> str | None:
    """msgspec names the bad field as `$.field`; OpenAI's `param` is the field's name."""
    at = message.rfind("`$.")
    if at >= 0:
        return message[at + 3:message.index("`", at + 1)].split("[")[0].split(".")[0]
    missing = message.find("missing required field `")
    if missing >= 0:
        start = missing + len("missing required field `")
        return message[start:message.index("`", start)]
    return None


def build_app(engine: AsyncLLM, model_name: str | None = None, chat_template: ChatTemplate | None = None) -> FastAPI:
    """The app over a started AsyncLLM. The caller owns the engine (and shuts it down)."""
    name = model_name or engine.model
    metrics = ServerMetrics(name, lambda: engine.stats)
    serving = OpenAIServing(engine, name, chat_template or ChatTemplate.for_model(engine.model), metrics)
    app = FastAPI(title="tokentape", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving

    def error(status: int, message: str, type: str, param: str | None = None) -> Response:
        metrics.errors.labels(status=str(status)).inc()
        return error_response(status, message, type, param)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return error(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ())]
        return error(422, f"{'.'.join(loc)}: {first.get('msg', 'invalid')}", "invalid_request_error",
                     loc[-1] if loc else None)

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
        req = await read_body(request, p.CompletionRequest)
        try:
            return await create_completion(serving, req, request)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await read_body(request, p.ChatCompletionRequest)
        try:
            return await create_chat_completion(serving, req, request)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

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

    # -- vLLM's RL endpoints -----------------------------------------------------------------------

    @app.post("/pause")
    async def pause(mode: Literal["abort", "wait", "keep"] = Query("abort"),
                    clear_cache: bool = Query(True)) -> Response:
        await engine.pause_generation(mode=mode, clear_cache=clear_cache)
        return json_response({"status": "paused"})

    @app.post("/resume")
    async def resume() -> Response:
        await engine.resume_generation()
        return json_response({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> Response:
        return json_response({"is_paused": await engine.is_paused()})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = Query(False)) -> Response:
        ok = await engine.reset_prefix_cache(reset_running_requests)
        return json_response({"success": ok})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> Response:
        req = await read_body(request, p.UpdateWeightsRequest)
        try:
            weights_id = await engine.update_weights(req.path)
        except EngineDeadError:
            raise
        except (ValueError, TypeError, RuntimeError, OSError) as exc:  # refused, nothing changed
            raise APIError(400, str(exc), param="path") from None
        return json_response({"status": "ok", "weights_id": weights_id})

    return app
