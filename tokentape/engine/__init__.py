"""The engine, laid out as vLLM's: the engine core (`engine.core`: EngineCore, its scheduler
and KV cache manager, EngineCoreProc), the front ends (LLMEngine, LLM, AsyncLLM) with their
one output processor, the settings, the runners and the model."""

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
