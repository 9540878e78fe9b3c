"""tokentape: an event-sourced LLM inference engine in the style of vLLM V1."""

from tokentape.engine import LLM, CompletionOutput, EngineConfig, RequestOutput, SamplingParams
from tokentape.engine.async_llm import AsyncLLM  # pyzmq only when it starts a core process
from tokentape.engine.outputs import RequestOutputKind
from tokentape.lora.request import LoRARequest
from tokentape.version import __version__

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "LoRARequest",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "__version__",
]
