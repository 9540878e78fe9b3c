"""The `tokentape` command line: generate (and record a tape), verify a tape, inspect a tape;
debug, diff, what-if replay and export (in tokentape/replay/commands.py).

    tokentape generate "Hello" "The capital of France is" --max-tokens 8
    tokentape replay verify tokentape-20250101T000000Z.tape
    tokentape inspect tokentape-20250101T000000Z.tape --step 3 --request 0

Expected failures (a file that is not a tape, a tape from a newer tokentape, a damaged tape,
an unknown request, bad engine arguments, an existing tape path) print one line
`error: <message>` on stderr and exit with status 2. `replay verify` exits 1 when the tape
does not reproduce.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sqlite3
import sys
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TextIO

from tokentape.replay.render import is_terminal, safe_text

EXIT_OK = 0
EXIT_DIVERGED = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130

DEFAULT_PROMPTS = (
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
)


class CLIError(Exception):
    """An expected failure: printed as `error: <message>`, exit status 2."""


def _expected_errors() -> tuple[type[BaseException], ...]:
    from tokentape.engine.llm_engine import EngineDeadError
    from tokentape.events.errors import ReducerError
    from tokentape.events.store import TapeError

    return (
        CLIError, TapeError, ReducerError, EngineDeadError, FileExistsError, ValueError,
        OSError, sqlite3.Error,
    )


# -- argument parsing ------------------------------------------------------------------------


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum, with a one-line error otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    from tokentape import __version__
    from tokentape.events.discard import DISCARD_POLICIES

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
            "  tokentape postmortem run.tape --html r.html  # what went wrong, and where\n"
            "  tokentape replay verify run.tape         # does the tape reproduce?\n"
            "  tokentape inspect run.tape --step 5      # derived state at step 5\n"
            "  tokentape debug run.tape                 # step through it, both ways\n"
            "  tokentape diff a.tape b.tape             # first output divergence\n"
            "  tokentape serve --model tiny --port 8000 # OpenAI-compatible server\n"
            "\n"
            "Expected failures print 'error: <message>' on stderr and exit with status 2."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tokentape {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    # generate ---------------------------------------------------------------------------------
    gen = sub.add_parser(
        "generate",
        help="generate completions and record a tape",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run prompts through tokentape.LLM(...).generate() and print every output\n"
            "(request id, finish reason, token ids, text). The run is recorded on a new tape\n"
            "file whose path is printed on stderr. Without any PROMPT or --file, a small\n"
            "built-in set of prompts is used."
        ),
        epilog=(
            "examples:\n"
            "  tokentape generate\n"
            "  tokentape generate 'Hello' 'Bonjour' --max-tokens 32 --tape run.tape\n"
            "  printf 'one\\ntwo\\n' | tokentape generate --file - --json --no-tape\n"
            "  tokentape generate --num-speculative-tokens 2 --discard-policy counter"
        ),
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (any number)")
    gen.add_argument(
        "--file", "-f", metavar="FILE", action="append", default=None,
        help="read prompts from FILE, one per line (blank lines skipped); '-' reads stdin; "
        "may be repeated",
    )
    gen.add_argument("--model", default="tiny",
                     help="model to serve: 'tiny' (default: the built-in model, seeded weights), "
                     "'qwen3-0.6b' (its shapes, seeded weights), a local Hugging Face checkpoint "
                     "folder, or the fake models 'oracle' and 'oracle-random'")
    gen.add_argument("--max-tokens", type=_positive_int, default=16, metavar="N",
                     help="maximum number of tokens generated per prompt (default: 16)")
    gen.add_argument("--temperature", type=float, default=1.0,
                     help="sampling temperature, recorded in each request's params (default: 1.0)")
    gen.add_argument("--seed", type=int, default=0,
                     help="engine seed: keys the model's sampling and goes into the tape header "
                     "(default: 0)")
    tape = gen.add_mutually_exclusive_group()
    tape.add_argument("--tape", metavar="PATH", default=None,
                      help="tape file to create; never overwritten "
                      "(default: tokentape-<UTC timestamp>.tape in the current directory)")
    tape.add_argument("--no-tape", action="store_true", help="do not write a tape file")
    pipe = gen.add_mutually_exclusive_group()
    pipe.add_argument("--sync", action="store_true",
                      help="synchronous scheduling: one step in flight at a time")
    pipe.add_argument("--pipeline-depth", type=_positive_int, default=None, metavar="N",
                      help="steps in flight with async scheduling (engine default: 2)")
    gen.add_argument("--num-speculative-tokens", type=_non_negative_int, default=None,
                     metavar="K", help="n-gram speculative tokens per decode (engine default: 0)")
    gen.add_argument("--discard-policy", choices=list(DISCARD_POLICIES), default=None,
                     help="how stale frames are recognised after a preemption "
                     "(engine default: epoch, the exact one; counter and flag reproduce vLLM's "
                     "historical bugs)")
    gen.add_argument("--num-kv-blocks", type=_positive_int, default=None, metavar="N",
                     help="number of paged KV cache blocks (engine default: 2048)")
    gen.add_argument("--block-size", type=_positive_int, default=None, metavar="N",
                     help="tokens per KV block (engine default: 16)")
    gen.add_argument("--max-num-seqs", type=_positive_int, default=None, metavar="N",
                     help="most requests running at once (engine default: 256)")
    gen.add_argument("--max-num-batched-tokens", type=_positive_int, default=None, metavar="N",
                     help="token budget of one step (engine default: 8192)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per output line instead of plain text")
    gen.set_defaults(func=cmd_generate)

    # replay -----------------------------------------------------------------------------------
    replay = sub.add_parser(
        "replay",
        help="replay a recorded tape (verify, whatif)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Replay a recorded tape. See 'tokentape replay verify --help' and\n"
        "'tokentape replay whatif --help'.",
    )
    replay_sub = replay.add_subparsers(dest="replay_command", metavar="COMMAND")
    ver = replay_sub.add_parser(
        "verify",
        help="check that the scheduler reproduces every recorded event",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Re-run the scheduler against the tape's recorded frames (no model needed) and\n"
            "check that every event it emits equals the recorded one.\n"
            "\n"
            "exit status: 0 when every event reproduces ('ok: N events reproduced'),\n"
            "1 at the first divergence (printed with the recorded events around it),\n"
            "2 when the tape cannot be read."
        ),
    )
    ver.add_argument("tape", metavar="TAPE", help="tape file to verify")
    ver.set_defaults(func=cmd_replay_verify)
    replay.set_defaults(func=lambda args: _missing_subcommand(replay))

    from tokentape.postmortem.cli import add_parser as add_postmortem_parser

    add_postmortem_parser(sub)  # tokentape postmortem

    from tokentape.entrypoints.serve import add_parser as add_serve_parser

    add_serve_parser(sub)  # tokentape serve

    # inspect ----------------------------------------------------------------------------------
    insp = sub.add_parser(
        "inspect",
        help="show the state derived from a tape",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Fold a tape into state (no scheduler, no model) and print it: the header,\n"
            "the engine-level state and one row per request. Tables are drawn with rich on\n"
            "a terminal and printed as plain text when stdout is piped."
        ),
        epilog=(
            "examples:\n"
            "  tokentape inspect run.tape\n"
            "  tokentape inspect run.tape --step 10\n"
            "  tokentape inspect run.tape --request 0 --json"
        ),
    )
    insp.add_argument("tape", metavar="TAPE", help="tape file to inspect")
    insp.add_argument("--step", type=_non_negative_int, default=None, metavar="N",
                      help="show the state at step N (after it was scheduled, before step N+1) "
                      "instead of at the end of the tape")
    insp.add_argument("--request", metavar="ID", default=None,
                      help="show one request's full derived state, output token ids included")
    insp.add_argument("--json", action="store_true", help="print JSON instead of tables")
    insp.set_defaults(func=cmd_inspect)

    from tokentape.replay.commands import add_commands  # debug, diff, export, replay whatif

    add_commands(sub, replay_sub)
    return parser


def _missing_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_ERROR


# -- generate ------------------------------------------------------------------------------


def _read_prompt_file(name: str) -> list[str]:
    if name == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(name, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise CLIError(f"cannot read prompts from {name}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise CLIError(
                f"cannot read prompts from {name}: not UTF-8 text ({exc.reason})"
            ) from None
    return [line for line in text.splitlines() if line.strip()]


def _collect_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    for i, p in enumerate(prompts):
        if not p:
            raise CLIError(f"prompt {i + 1} is empty")
    for name in args.file or ():
        from_file = _read_prompt_file(name)
        if not from_file:
            raise CLIError(f"no prompts in {'stdin' if name == '-' else name}")
        prompts.extend(from_file)
    if not prompts:
        prompts = list(DEFAULT_PROMPTS)
    return prompts


def _default_tape_path() -> str:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = f"tokentape-{stamp}.tape"
    n = 1
    while os.path.exists(path):  # a second run within the same second
        n += 1
        path = f"tokentape-{stamp}-{n}.tape"
    return path


def _engine_args(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"seed": args.seed}
    if args.sync:
        kwargs["async_scheduling"] = False
    if args.pipeline_depth is not None:
        kwargs["pipeline_depth"] = args.pipeline_depth
    for name in ("num_speculative_tokens", "discard_policy", "num_kv_blocks", "block_size",
                 "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    return kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    from tokentape import LLM, SamplingParams

    prompts = _collect_prompts(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.no_tape:
        tape: str | None = None  # an in-memory tape, dropped at exit
    else:
        tape = args.tape if args.tape is not None else _default_tape_path()
        parent = os.path.dirname(os.path.abspath(tape))
        if not os.path.isdir(parent):
            raise CLIError(f"{tape}: cannot create the tape, directory {parent} does not exist")
        if os.path.exists(tape):
            raise CLIError(f"{tape}: a tape already exists here; choose a new path with --tape")
    llm = LLM(args.model, tape=tape, **_engine_args(args))
    path = llm.tape_path
    try:
        outputs = llm.generate(prompts, params)
    except _expected_errors() as exc:
        where = f" (the tape up to the failure is at {path})" if path else ""
        raise CLIError(f"{exc}{where}") from None
    except BaseException:
        if path:
            print(f"tape: {path} (recorded up to the failure)", file=sys.stderr)
        raise
    finally:
        llm.close()

    out = sys.stdout
    for o in outputs:
        c = o.outputs[0]
        if args.json:
            record = {
                "request_id": o.request_id,
                "prompt": o.prompt,
                "prompt_token_ids": o.prompt_token_ids,
                "finish_reason": c.finish_reason,
                "finished": o.finished,
                "token_ids": c.token_ids,
                "text": c.text,
            }
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        else:
            out.write(safe_text(
                f"request {o.request_id}: finish_reason={c.finish_reason} "
                f"num_tokens={len(c.token_ids)}\n"
                f"  prompt:    {o.prompt!r}\n"
                f"  token_ids: {c.token_ids}\n"
                f"  text:      {c.text!r}\n"
            ))
    out.flush()
    if path:
        print(f"tape: {path}", file=sys.stderr)
    else:
        print("tape: none (--no-tape)", file=sys.stderr)
    return EXIT_OK


# -- replay verify -------------------------------------------------------------------------


def cmd_replay_verify(args: argparse.Namespace) -> int:
    from tokentape.replay import verify

    result = verify(args.tape)
    if result.ok:
        line = f"ok: {result.num_events} events reproduced"
        if result.ended_with_error:
            line += f" (the recorded run stopped on an engine error: {result.ended_with_error})"
        print(safe_text(line))
        return EXIT_OK
    print(safe_text(f"FAILED: {args.tape} does not reproduce ({result.num_events} events reproduced)"))
    if result.first_divergence is not None:
        print(safe_text(result.first_divergence.format()))
    return EXIT_DIVERGED


# -- inspect -------------------------------------------------------------------------------


def _yes_no(value: bool) -> str:
    return "yes" if value else "no"


def _header_summary(tape: Any, num_events: int) -> dict[str, Any]:
    h, c = tape.header, tape.config
    depth = c.effective_pipeline_depth
    return {
        "tape": tape.path or "<memory>",
        "format version": h.format_version,
        "package version": h.package_version,
        "created at": h.created_at or "-",
        "model": h.model_id,
        "discard policy": h.discard_policy,
        "seed": h.seed,
        "scheduling": f"async, pipeline depth {depth}" if depth > 1 else "sync (pipeline depth 1)",
        "speculative tokens": c.num_speculative_tokens,
        "kv cache": f"{c.num_kv_blocks} blocks x {c.block_size} tokens = {c.kv_capacity} tokens",
        "prefix caching": _yes_no(c.enable_prefix_caching),
        "max num seqs": c.max_num_seqs,
        "max num batched tokens": c.max_num_batched_tokens,
        "max model len": c.effective_max_model_len,
        "events": num_events,
    }


def _engine_summary(state: Any) -> dict[str, Any]:
    in_flight = [s.step for s in state.in_flight_steps]
    return {
        "steps scheduled": state.step,
        "paused": state.paused or "no",
        "waiting": len(state.waiting),
        "running": len(state.running),
        "in-flight steps": f"{len(in_flight)} {in_flight}" if in_flight else "0",
        "prefix cache resets": state.num_prefix_cache_resets,
        "weights id": state.weights_id or "-",
        "requests": len(state.requests),
        "finished": sum(1 for r in state.requests.values() if r.is_finished),
        "events folded": state.num_events,
        "engine error": state.error or "-",
    }


_REQUEST_COLUMNS = (
    "id", "status", "prompt", "output", "computed", "placeholders", "epoch", "discard",
    "preemptions", "blocks", "dropped", "finish",
)


def _request_row(state: Any, req: Any) -> tuple[Any, ...]:
    return (
        req.req_id, req.status.value, req.num_prompt_tokens, len(req.output_token_ids),
        req.num_computed_tokens, req.num_output_placeholders, req.epoch,
        state.discard_count(req), req.num_preemptions, len(req.block_ids),
        req.num_frames_dropped, req.finish_reason or "-",
    )


def _request_detail(state: Any, req: Any) -> dict[str, Any]:
    import msgspec

    return {
        "req_id": req.req_id,
        "status": req.status.value,
        "arrival_step": req.arrival_step,
        "params": msgspec.to_builtins(msgspec.structs.asdict(req.params)),
        "num_prompt_tokens": req.num_prompt_tokens,
        "prompt_token_ids": list(req.prompt_token_ids),
        "num_output_tokens": len(req.output_token_ids),
        "output_token_ids": list(req.output_token_ids),
        "num_emitted": req.num_emitted,
        "num_computed_tokens": req.num_computed_tokens,
        "num_output_placeholders": req.num_output_placeholders,
        "epoch": req.epoch,
        "discard_count": state.discard_count(req),
        "async_tokens_to_discard": req.async_tokens_to_discard,
        "discard_latest_async_tokens": req.discard_latest_async_tokens,
        "num_frames_dropped": req.num_frames_dropped,
        "num_preemptions": req.num_preemptions,
        "block_ids": list(req.block_ids),
        "in_flight": [
            {"step": step, "epoch": e.epoch, "num_spec_tokens": e.num_spec_tokens,
             "stale": e.epoch != req.epoch}
            for step, e in state.in_flight_entries(req.req_id)
        ],
        "stop_reason": req.stop_reason,
        "finish_reason": req.finish_reason,
        "output_pending": req.req_id in state.pending_output,
    }


class _PlainView:
    def __init__(self, out: TextIO) -> None:
        self.out = out

    def section(self, title: str, pairs: dict[str, Any]) -> None:
        self.out.write(f"{safe_text(title)}\n")
        width = max((len(k) for k in pairs), default=0)
        for key, value in pairs.items():
            self.out.write(f"  {key:<{width}}  {safe_text(str(value))}\n")
        self.out.write("\n")

    def table(self, title: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
        self.out.write(f"{safe_text(title)}\n")
        cells = [list(columns)] + [[safe_text(str(v)) for v in row] for row in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
        for r in cells:
            line = "  ".join(
                v.ljust(w) if i < 2 or i == len(columns) - 1 else v.rjust(w)
                for i, (v, w) in enumerate(zip(r, widths))
            )
            self.out.write(f"  {line.rstrip()}\n")
        if not rows:
            self.out.write("  (no requests)\n")


class _RichView:
    # Short headers (explained in the caption) keep the request table inside 80 columns.
    _HEADERS: ClassVar[dict[str, str]] = {
        "computed": "comp", "placeholders": "ph", "discard": "disc", "preemptions": "preempt",
    }
    _CAPTION = ("prompt/output: lengths, comp: num_computed_tokens, ph: num_output_placeholders, "
                "disc: discard count, dropped: frames dropped")

    def __init__(self, out: TextIO) -> None:
        from rich.console import Console

        self.console = Console(file=out, highlight=False)

    def section(self, title: str, pairs: dict[str, Any]) -> None:
        from rich.table import Table
        from rich.text import Text

        self.console.print(safe_text(title), style="bold", markup=False)
        table = Table(show_header=False, box=None, padding=(0, 2))
        table.add_column(style="cyan", no_wrap=True)
        table.add_column(overflow="fold")
        for key, value in pairs.items():
            table.add_row(key, Text(safe_text(str(value))))
        self.console.print(table)
        self.console.print()

    def table(self, title: str, columns: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        self.console.print(safe_text(title), style="bold", markup=False)
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                      caption=self._CAPTION, caption_justify="left")
        for i, name in enumerate(columns):
            numeric = 1 < i < len(columns) - 1
            table.add_column(self._HEADERS.get(name, name), justify="right" if numeric else "left",
                             overflow="fold", style="bold" if i == 0 else None,
                             no_wrap=i == 1)
        for row in rows:
            # The finish column says why a request finished; "finished" is enough here.
            status = "finished" if str(row[1]).startswith("finished") else row[1]
            table.add_row(*(Text(safe_text(str(v))) for v in (row[0], status, *row[2:])))
        self.console.print(table)


def _locate_fold_failure(tape: Any, exc: BaseException) -> str:
    """Fold again, event by event, to name the event the reducer refused."""
    from tokentape.events.errors import FOLD_ERRORS, event_refused
    from tokentape.events.reducer import evolve

    state = tape.initial_state()
    for seq, event in tape.events():
        try:
            evolve(state, event)
        except FOLD_ERRORS as inner:  # now with its position
            return f"{tape.path}: the tape is inconsistent: {event_refused(seq, event, inner)}"
    return f"{tape.path}: the tape is inconsistent: {_one_line(exc)}"


def cmd_inspect(args: argparse.Namespace) -> int:
    from tokentape.events.errors import FOLD_ERRORS
    from tokentape.replay import load_tape

    tape = load_tape(args.tape)
    num_events = len(tape)
    try:
        state = tape.fold() if args.step is None else tape.at(args.step)
    except FOLD_ERRORS as exc:
        # The events cannot follow each other (a damaged or hand-edited tape).
        raise CLIError(_locate_fold_failure(tape, exc)) from None
    if args.step is not None and state.step <= args.step:
        print(f"note: {args.tape} ends before step {args.step} is scheduled "
              f"(it has {state.step} steps); showing its final state", file=sys.stderr)
    where = "at the end of the tape" if args.step is None else f"at step {args.step}"

    if args.request is not None:
        req = state.requests.get(args.request)
        if req is None:
            known = list(state.requests)
            listed = ", ".join(map(repr, known[:10])) + (", ..." if len(known) > 10 else "")
            raise CLIError(
                f"{args.tape}: no request {args.request!r} {where} "
                f"({len(known)} requests{': ' + listed if known else ''})"
            )
        detail = _request_detail(state, req)
        if args.json:
            print(json.dumps({"tape": tape.path, "step": args.step, "request": detail}))
            return EXIT_OK
        view = _RichView(sys.stdout) if is_terminal(sys.stdout) else _PlainView(sys.stdout)
        view.section(f"request {req.req_id!r} {where}", detail)
        return EXIT_OK

    if args.json:
        import msgspec

        record = {
            "tape": tape.path,
            "num_events": num_events,
            "step": args.step,
            "header": msgspec.to_builtins(tape.header),
            "engine": {
                "step": state.step,
                "paused": state.paused,
                "waiting": list(state.waiting),
                "running": list(state.running),
                "in_flight_steps": [s.step for s in state.in_flight_steps],
                "num_prefix_cache_resets": state.num_prefix_cache_resets,
                "weights_id": state.weights_id,
                "num_events": state.num_events,
                "error": state.error,
            },
            "requests": [dict(zip(_REQUEST_COLUMNS, _request_row(state, r)))
                         for r in state.requests.values()],
        }
        print(json.dumps(record))
        return EXIT_OK

    view = _RichView(sys.stdout) if is_terminal(sys.stdout) else _PlainView(sys.stdout)
    view.section("tape", _header_summary(tape, num_events))
    view.section(f"engine state {where}", _engine_summary(state))
    view.table(f"requests ({len(state.requests)})", _REQUEST_COLUMNS,
               [_request_row(state, r) for r in state.requests.values()])
    return EXIT_OK


# -- entry point ---------------------------------------------------------------------------


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
    except _expected_errors() as exc:
        print(f"error: {safe_text(_one_line(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _one_line(exc: BaseException) -> str:
    from tokentape.events.errors import one_line

    return one_line(exc)


if __name__ == "__main__":
    sys.exit(main())
