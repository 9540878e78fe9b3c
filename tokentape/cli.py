"""The `tokentape` command line: one parser wired from each command family's module.

    tokentape generate "Hello" "The capital of France is" --max-tokens 8
    tokentape replay verify tokentape-20250101T000000Z.tape
    tokentape inspect tokentape-20250101T000000Z.tape --step 3 --request 0

The commands live in tokentape/entrypoints/cli/ (generate, inspect, replay, debug, diff,
export, why, bisect, chaos, postmortem, serve), each with `add_parser(subparsers)`. Expected
failures (a file that is not a tape, a tape from a newer tokentape, a damaged tape, an unknown
request, bad engine arguments, an existing output file without --force) print one line
`error: <message>` on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from tokentape.entrypoints.cli.common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    CLIError,
    expected_errors,
    one_line,
)
from tokentape.replay.render import safe_text

__all__ = ["CLIError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from tokentape.entrypoints.cli import (
        bisect,
        chaos,
        debug,
        diff,
        export,
        generate,
        inspect,
        postmortem,
        replay,
        serve,
        why,
    )
    from tokentape.version import __version__

    parser = argparse.ArgumentParser(
        prog="tokentape",
        description=(
            "tokentape: an event-sourced LLM inference engine. Every scheduling decision and\n"
            "output frame goes on a replayable tape (an SQLite file)."
        ),
        epilog=(
            "examples:\n"
            "  tokentape generate                       # built-in prompts, records a tape\n"
            "  tokentape generate 'Hello' --max-tokens 8 --json\n"
            "  tokentape generate --discard-policy flag --pause-at 4 --tape bug.tape\n"
            "  tokentape postmortem bug.tape            # names vLLM #42043 in it\n"
            "  tokentape debug bug.tape                 # step through it, both ways\n"
            "  tokentape replay verify run.tape         # does the tape reproduce?\n"
            "  tokentape inspect run.tape --step 5      # derived state at step 5\n"
            "  tokentape diff a.tape b.tape             # first output divergence\n"
            "  tokentape why bug.tape 0 4               # the events behind one output token\n"
            "  tokentape bisect a.tape b.tape           # first differing event, O(log n) reads\n"
            "  tokentape chaos --seeds 100 --out chaos/ # seeded storms against the oracle\n"
            "  tokentape serve --model tiny --port 8000 # OpenAI-compatible server\n"
            "\n"
            "Expected failures print 'error: <message>' on stderr and exit with status 2.\n"
            "Output files are never overwritten unless --force is given."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tokentape {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for family in (
        generate,
        replay,
        postmortem,
        serve,
        inspect,
        debug,
        diff,
        export,
        why,
        bisect,
        chaos,
    ):
        family.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    try:
        return args.func(args)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, without a second error at exit.
        with open(os.devnull, "w") as devnull:
            try:
                os.dup2(devnull.fileno(), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
        return EXIT_OK
    except expected_errors() as exc:
        print(f"error: {safe_text(one_line(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    # Run as `python -m tokentape.cli`, this file is `__main__`, a second copy of the module;
    # everything it catches is defined in tokentape.entrypoints.cli.common, shared by both.
    sys.exit(main())
