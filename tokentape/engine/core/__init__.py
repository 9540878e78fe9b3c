"""AsyncLLM's engine core: the EngineCore (owns the engine and writes the tape), its process
entry point, its msgspec messages and the frontend's clients (ZMQ or in-process)."""
