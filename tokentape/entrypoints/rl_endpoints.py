"""vLLM's RL endpoints, by vLLM's names: POST /pause, POST /resume, GET /is_paused, POST
/reset_prefix_cache, POST /update_weights; vLLM's sleep mode: POST /sleep?level=N&mode=M,
POST /wake_up?tags=T (repeated; none: everything), GET /is_sleeping; and SGLang's POST
/abort_request ({"rid": ID} or {"abort_all": true}), which vLLM has no endpoint for.

They change what every client gets (a pause freezes every stream; new weights change every
later token), so a server attaches them only when asked (`--enable-rl-endpoints`, or vLLM's
dev-mode variable VLLM_SERVER_DEV_MODE=1), behind the API key when there is one, and
/update_weights loads only folders under `--allowed-weight-dirs`: a path elsewhere is refused
with one message whether or not it exists, so the endpoint says nothing of the rest of the
disk. An update the engine refuses (a bad checkpoint, not paused) is a 400; the engine
serves on with its old weights.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request
from starlette.responses import Response

from tokentape.engine.async_llm import AsyncLLM
from tokentape.engine.rl_calls import check_wake_tags
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.refusals import APIError
from tokentape.entrypoints.request_body import decode_body
from tokentape.errors import EngineDeadError

RL_PATHS = (
    "/pause",
    "/resume",
    "/is_paused",
    "/reset_prefix_cache",
    "/update_weights",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/abort_request",
)
DEV_MODE_ENV_VAR = "VLLM_SERVER_DEV_MODE"


def dev_mode(environ: dict[str, str] | None = None) -> bool:
    """vLLM's dev mode, which serves its RL and sleep endpoints: VLLM_SERVER_DEV_MODE=1."""
    env = os.environ if environ is None else environ
    return env.get(DEV_MODE_ENV_VAR, "").strip().lower() in ("1", "true")


def weight_dirs(dirs: Sequence[str]) -> list[str]:
    """The allowed folders, resolved once (symbolic links followed), as absolute paths."""
    return [os.path.realpath(os.path.abspath(d)) for d in dirs]


def allowed_weights_path(path: str, allowed: Sequence[str]) -> str:
    """The checkpoint folder to load: `path` resolved (links followed) when it lies under an
    allowed folder. Otherwise an APIError that is the same whatever exists at `path`."""
    if not allowed:
        raise APIError(
            403,
            "/update_weights loads no path: the server was started without --allowed-weight-dirs",
            param="path",
        )
    if "\0" in path or not os.path.isabs(path):
        raise APIError(400, "path must be an absolute path", param="path")
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, d]) == d for d in allowed):
        raise APIError(
            403,
            "path is not under a folder the server allows (--allowed-weight-dirs)",
            param="path",
        )
    return real


async def refused_as_400(call: Awaitable[object], param: str) -> object:
    """An engine call whose refusal (the engine serves on) is the client's 400; a dead engine
    stays a 503."""
    try:
        return await call
    except EngineDeadError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the engine refused, it changed nothing
        raise APIError(400, str(exc), param=param) from None


def add_rl_endpoints(
    app: FastAPI,
    engine: AsyncLLM,
    allowed_weight_dirs: Sequence[str],
    json_response: Callable[[object], Response],
) -> None:
    """Attach the RL endpoints to `app` (the caller decides whether to)."""
    allowed = weight_dirs(allowed_weight_dirs)

    @app.post("/pause")
    async def pause(
        mode: Literal["abort", "wait", "keep"] = Query("abort"), clear_cache: bool = Query(True)
    ) -> Response:
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

    @app.post("/sleep")
    async def sleep(
        level: int = Query(1, ge=0, le=2), mode: Literal["abort", "wait", "keep"] = Query("abort")
    ) -> Response:
        # vLLM's answer: 200 with no body, once the engine is asleep (drained first); a
        # sleep that broke the engine is a 503 (EngineDeadError), never a 200 (vLLM #45520).
        await refused_as_400(engine.sleep(level, mode), "level")
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
        try:
            checked = check_wake_tags(tags)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tags") from None
        await refused_as_400(engine.wake_up(checked), "tags")
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return json_response({"is_sleeping": await engine.is_sleeping()})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        req = decode_body(await request.body(), p.AbortRequest)
        if req.abort_all:
            return json_response({"aborted": await engine.abort_all()})
        if not req.rid:
            raise APIError(400, "give a request id (rid) or abort_all: true", param="rid")
        known = engine.is_streaming(req.rid)
        await engine.abort(req.rid)
        return json_response({"aborted": [req.rid] if known else []})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> Response:
        req = decode_body(await request.body(), p.UpdateWeightsRequest)
        folder = allowed_weights_path(req.path, allowed)
        try:
            weights_id = await engine.update_weights(folder)
        except EngineDeadError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the update raised, it was refused
            raise APIError(400, str(exc), param="path") from None
        return json_response({"status": "ok", "weights_id": weights_id})
