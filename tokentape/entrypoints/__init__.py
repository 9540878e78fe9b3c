"""Entry points: the `tokentape` subcommands (tokentape/entrypoints/cli/, wired by
tokentape.cli) and `tokentape serve`, the OpenAI-compatible HTTP server over AsyncLLM."""
