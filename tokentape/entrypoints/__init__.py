"""Entry points over AsyncLLM: `tokentape serve`, the OpenAI-compatible HTTP server."""
