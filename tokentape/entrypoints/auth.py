"""API keys, as vLLM's `--api-key`: a request to a protected route must carry
`Authorization: Bearer <key>`, or it gets a 401 and reaches nothing.

Protected: every /v1 route, the RL endpoints (rl_endpoints.RL_PATHS), whichever are
served, and the other routes that run the model or its tokenizer (api_server: /tokenize,
/detokenize, /inference/v1/generate). /health and /metrics stay open, as vLLM's do (a load
balancer and a scraper read them). A pure ASGI middleware: streamed responses pass through
it untouched.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from typing import Any

from starlette.responses import Response

# Where the key is read from when --api-key is not given: ours first, then vLLM's, so a
# deployment that sets vLLM's variable is not left open by mistake.
API_KEY_ENV_VARS = ("TOKENTAPE_API_KEY", "VLLM_API_KEY")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def api_keys_from(flag: str | None, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """The keys the server accepts: --api-key, else the first variable of API_KEY_ENV_VARS
    that is set and not empty; none means no key is asked for."""
    if flag:
        return [flag]
    env = os.environ if environ is None else environ
    for name in API_KEY_ENV_VARS:
        if env.get(name):
            return [env[name]]
    return []


class APIKeyMiddleware:
    """Refuse a protected route's request without a valid Bearer token (constant-time
    comparison, so the time taken says nothing of the key)."""

    def __init__(
        self,
        app: ASGIApp,
        keys: Sequence[str],
        protected_paths: Iterable[str],
        error: Callable[[], Response],
    ) -> None:
        self.app = app
        self.tokens = [f"Bearer {key}".encode() for key in keys]
        self.protected_paths = frozenset(protected_paths)
        self.error = error

    def protects(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or path in self.protected_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or not self.protects(scope["path"])
            or self.authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        await self.error()(scope, receive, send)

    def authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        # Every key is compared, so the time taken does not say which one came close.
        matches = [hmac.compare_digest(given, token) for token in self.tokens]
        return any(matches)
