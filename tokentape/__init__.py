"""tokentape: an event-sourced LLM inference engine in the style of vLLM V1."""

__version__ = "0.1.0"

from tokentape.engine import LLM, CompletionOutput, EngineConfig, RequestOutput, SamplingParams  # noqa: E402
from tokentape.engine.async_llm import AsyncLLM  # noqa: E402  (pyzmq only when it starts a core process)
from tokentape.engine.outputs import RequestOutputKind  # noqa: E402

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "__version__",
]
