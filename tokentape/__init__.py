"""tokentape: an event-sourced LLM inference engine in the style of vLLM V1."""

__version__ = "0.1.0"

from tokentape.engine import LLM, CompletionOutput, EngineConfig, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams", "__version__"]
