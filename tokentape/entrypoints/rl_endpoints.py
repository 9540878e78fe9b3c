"""vLLM's RL endpoints, by vLLM's names: POST /pause, POST /resume, GET /is_paused, POST
/reset_prefix_cache, POST /update_weights; the chunked transfer POST /start_weight_update,
then /update_weights per chunk, then POST /finish_weight_update (vLLM #39212, its
`weight_version` in the body: #49040), and GET /weight_info (the version serving now);
vLLM's sleep mode: POST /sleep?level=N&mode=M, POST /wake_up?tags=T (repeated; none:
everything), GET /is_sleeping; and SGLang's POST /abort_request ({"rid": ID} or
{"abort_all": true}), which vLLM has no endpoint for. POST /collective_rpc (worker code by
name, worker_extension_cls's) is served in vLLM's dev mode only. With
--weight-transfer-config, vLLM's weight transfer engine's POST /init_weight_transfer_engine
{"init_info": {...}} too, and /update_weights takes a bucket's {"update_info": {...}}
(engine/weight_transfer.py: the tensors are in the trainer's shared memory, named by the
update_info; no folder is read).

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
from typing import Annotated, Literal, TypeVar

from fastapi import FastAPI, Query, Request
from starlette.responses import Response

from tokentape.engine.async_llm import AsyncLLM
from tokentape.engine.core.call_args import check_wake_tags
from tokentape.engine.weight_transfer import check_update_info
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.refusals import APIError
from tokentape.entrypoints.request_body import decode_body
from tokentape.errors import EngineDeadError, WorkerCallRefused

RL_PATHS = (
    "/pause",
    "/resume",
    "/is_paused",
    "/reset_prefix_cache",
    "/update_weights",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/finish_weight_update",
    "/weight_info",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/abort_request",
)
COLLECTIVE_RPC_PATH = "/collective_rpc"
DEV_MODE_ENV_VAR = "VLLM_SERVER_DEV_MODE"
T = TypeVar("T")


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
        await _refused_as_400(engine.resume_generation(), None)  # a transfer still open
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
        await _refused_as_400(engine.sleep(level, mode), "level")
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
        try:
            checked = check_wake_tags(tags)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tags") from None
        await _refused_as_400(engine.wake_up(checked), "tags")
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

    async def loaded(weights_id: str | None) -> Response:
        """The answer to an update that loaded new weights: their hash and version."""
        return json_response(
            {
                "status": "ok",
                "weights_id": weights_id,
                "weight_version": await engine.get_weight_version(),
            }
        )

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> Response:
        body = await request.body()
        req = decode_body(body, p.InitWeightTransferEngineRequest) if body.strip() else None
        init_info = req.init_info if req is not None else {}
        await _refused_as_400(engine.init_weight_transfer_engine(init_info), "init_info")
        return json_response({"status": "ok"})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> Response:
        req = decode_body(await request.body(), p.UpdateWeightsRequest)
        if (req.path is None) == (req.update_info is None):
            raise APIError(
                400,
                "give a checkpoint folder (path) or, with --weight-transfer-config, a "
                "bucket's update_info; one of them",
                param="path" if req.path is None else "update_info",
            )
        if req.update_info is not None:  # a bucket of the weight transfer engine: a chunk
            try:
                info = check_update_info(req.update_info).as_dict()
            except ValueError as exc:
                raise APIError(400, str(exc), param="update_info") from None
            await _refused_as_400(engine.update_weights(info, req.weight_version), "update_info")
            return json_response({"status": "ok"})
        assert req.path is not None
        folder = allowed_weights_path(req.path, allowed)
        weights_id = await _refused_as_400(
            engine.update_weights(folder, req.weight_version), "path"
        )
        if weights_id is None:  # a chunk of a transfer: held until /finish_weight_update
            return json_response({"status": "ok"})
        return await loaded(weights_id)

    @app.post("/start_weight_update")
    async def start_weight_update() -> Response:
        await _refused_as_400(engine.start_weight_update(), None)
        return json_response({"status": "ok"})

    @app.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> Response:
        body = await request.body()
        req = decode_body(body, p.FinishWeightUpdateRequest) if body.strip() else None
        version = req.weight_version if req is not None else None
        weights_id = await _refused_as_400(
            engine.finish_weight_update(version), "weight_version" if version else None
        )
        return await loaded(weights_id)

    @app.get("/weight_info")
    async def weight_info() -> Response:
        return json_response({"weight_version": await engine.get_weight_version()})


def add_collective_rpc_endpoint(
    app: FastAPI, engine: AsyncLLM, json_response: Callable[[object], Response]
) -> None:
    """vLLM's dev-mode POST /collective_rpc: {"method", "timeout", "args", "kwargs"} ->
    {"results": [...]} (a result that is not JSON's dict, list or null as its str, as vLLM
    answers). A call refused before it ran (no such method, bad arguments) is a 400; a
    method that raised (on the tape) a 500 with the error's type and message; the engine
    serves on."""

    @app.post(COLLECTIVE_RPC_PATH)
    async def collective_rpc(request: Request) -> Response:
        req = decode_body(await request.body(), p.CollectiveRPCRequest)
        try:
            results = await engine.collective_rpc(
                req.method, req.timeout, tuple(req.args), req.kwargs
            )
        except EngineDeadError:
            raise
        except WorkerCallRefused as exc:  # no such method, bad arguments: nothing ran
            raise APIError(400, str(exc), param="method") from None
        except Exception as exc:  # noqa: BLE001 - the method raised (on the tape): a 500
            raise APIError(500, f"{type(exc).__name__}: {exc}", "InternalServerError") from None
        return json_response(
            {
                "results": [
                    r if r is None or isinstance(r, (dict, list)) else str(r) for r in results
                ]
            }
        )


async def _refused_as_400(call: Awaitable[T], param: str | None) -> T:
    """The engine's refusal of a call (a weight call not paused, a bad chunk, no transfer open;
    a resume with a transfer open or asleep; a sleep or wake-up it cannot do) as a 400 with
    its message; the engine serves on as it was. A dead engine stays a 503."""
    try:
        return await call
    except EngineDeadError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the call raised, it was refused
        raise APIError(400, str(exc), param=param) from None
