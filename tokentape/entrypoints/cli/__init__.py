"""The `tokentape` subcommands, one module per family, each with `add_parser(subparsers)`
(as vLLM's `vllm/entrypoints/cli`): generate, inspect, replay (verify, whatif), debug, diff,
export and postmortem here (the postmortem's report printers live in tokentape/postmortem),
serve in tokentape/entrypoints/serve.py. `tokentape.cli` wires them into one parser."""
