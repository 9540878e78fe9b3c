"""The `tokentape` subcommands, one module per family, each with `add_parser(subparsers)`
(as vLLM's `vllm/entrypoints/cli`): generate, inspect, replay (verify, whatif), debug, diff,
export, postmortem (its report printers live in tokentape/postmortem) and serve (the server
it runs is tokentape/entrypoints/api_server.py). `tokentape.cli` wires them into one parser."""
