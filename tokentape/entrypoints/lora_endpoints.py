"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"}. As vLLM, they are served only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING set (they change what a served model name means), behind
the API key as every /v1 route. A loaded adapter is served under its name: a request whose
`model` is that name runs with it (serving_engine.OpenAIServing.lora_for). Each load and
unload goes on the tape (LoRAAdded, LoRARemoved); a refused one (a folder that cannot serve,
a name taken or unknown, an adapter in use) records nothing and is a 4xx."""

from __future__ import annotations

import os
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from tokentape.engine.async_llm import AsyncLLM
from tokentape.entrypoints import protocol as p
from tokentape.entrypoints.refusals import APIError
from tokentape.entrypoints.request_body import decode_body
from tokentape.entrypoints.serving_engine import OpenAIServing
from tokentape.errors import EngineDeadError, LoRAError

RUNTIME_LORA_ENV_VAR = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """vLLM's switch for the runtime LoRA endpoints: the variable set to true or 1."""
    return os.environ.get(RUNTIME_LORA_ENV_VAR, "").strip().lower() in ("1", "true")


def add_lora_endpoints(
    app: FastAPI, engine: AsyncLLM, serving: OpenAIServing, json_response: Callable[..., Response]
) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        req = decode_body(await request.body(), p.LoadLoRAAdapterRequest)
        if req.lora_name in serving.lora_requests or req.lora_name == serving.model_name:
            raise APIError(
                400,
                f"The lora adapter '{req.lora_name}' has already been loaded.",
                param="lora_name",
            )
        lora = serving.add_lora_module(req.lora_name, req.lora_path)
        try:
            await engine.add_lora(lora)
        except EngineDeadError:
            del serving.lora_requests[req.lora_name]
            raise
        except (LoRAError, ValueError, TypeError) as exc:
            del serving.lora_requests[req.lora_name]
            raise APIError(400, str(exc), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        req = decode_body(await request.body(), p.UnloadLoRAAdapterRequest)
        lora = serving.lora_requests.get(req.lora_name)
        if lora is None or (req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id):
            raise APIError(
                404,
                f"The lora adapter '{req.lora_name}' cannot be found.",
                "NotFoundError",
                "lora_name",
            )
        try:
            await engine.remove_lora(lora.lora_int_id)
        except EngineDeadError:
            raise
        except (LoRAError, ValueError) as exc:  # it serves unfinished requests
            raise APIError(400, str(exc), param="lora_name") from None
        del serving.lora_requests[req.lora_name]
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
