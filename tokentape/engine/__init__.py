"""The engine: requests, KV cache manager, scheduler, engine loop, runners and the LLM API."""

from tokentape.engine.config import EngineConfig
from tokentape.engine.llm import LLM
from tokentape.engine.llm_engine import LLMEngine
from tokentape.engine.outputs import CompletionOutput, RequestOutput
from tokentape.events.schema import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
