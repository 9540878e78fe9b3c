"""`tokentape generate`: run prompts through `LLM.generate`, print the outputs and record a
tape; `--pause-at`, `--reset-at` and `--abort-at` script the engine calls of an RL loop
(tokentape.engine.scenario), so a run that shows a bug can be recorded from the shell."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tokentape.engine.arg_utils import (
    ENGINE_FLAGS,
    LORA_FLAGS,
    add_engine_cli_args,
    engine_args_from_cli,
)
from tokentape.entrypoints.cli.common import (
    EXIT_OK,
    CLIError,
    add_tape_arguments,
    check_output_path,
    expected_errors,
    positive_int,
    remove_for_overwrite,
    timestamped_tape_path,
)
from tokentape.entrypoints.cli.generate_script import (
    add_script_arguments,
    scenario_of,
    warn_pending,
)
from tokentape.replay.render import safe_text

DEFAULT_PROMPTS = (
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate",
        help="generate completions and record a tape",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run prompts through tokentape.LLM(...).generate() and print every output\n"
            "(request id, finish reason, token ids, text). The run is recorded on a new tape\n"
            "file whose path is printed on stderr. Without any PROMPT or --file, a small\n"
            "built-in set of prompts is used. Request ids are 0, 1, ... in prompt order.\n"
            "On a terminal, a progress bar goes to stderr while it runs."
        ),
        epilog=(
            "examples:\n"
            "  tokentape generate\n"
            "  tokentape generate 'Hello' 'Bonjour' --max-tokens 32 --tape run.tape\n"
            "  printf 'one\\ntwo\\n' | tokentape generate --file - --json --no-tape\n"
            "  tokentape generate --num-speculative-tokens 2 --discard-policy counter\n"
            "  tokentape generate --discard-policy flag --pause-at 4 --tape bug.tape"
            "  # vLLM #42043"
        ),
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (any number)")
    gen.add_argument(
        "--file",
        "-f",
        metavar="FILE",
        action="append",
        default=None,
        help="read prompts from FILE, one per line (blank lines skipped); '-' reads stdin; "
        "may be repeated",
    )
    gen.add_argument(
        "--max-tokens",
        type=positive_int,
        default=16,
        metavar="N",
        help="maximum number of tokens generated per prompt (default: 16)",
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature, recorded in each request's params (default: 1.0)",
    )
    add_tape_arguments(gen, "tokentape")
    # --model, --seed, --sync and the engine's flags (arg_utils.py), but LoRA's: a prompt
    # file names no adapter.
    add_engine_cli_args(gen, [f for f in ENGINE_FLAGS if f not in LORA_FLAGS])
    add_script_arguments(gen)
    gen.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per output line instead of plain text",
    )
    gen.set_defaults(func=cmd_generate)
    return gen


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


def _tape_path(args: argparse.Namespace) -> str | None:
    """The tape to create, checked (and an existing one removed under --force) before the run."""
    if args.no_tape:
        return None  # an in-memory tape, dropped at exit
    if args.tape is None:
        return timestamped_tape_path("tokentape")
    if check_output_path(args.tape, args.force, "--tape"):
        remove_for_overwrite(args.tape)
    return args.tape


def _has_random_weights(model: str) -> bool:
    from tokentape.engine.model_registry import BUILTIN_MODELS

    return model in BUILTIN_MODELS


def _check_model(model: str) -> None:
    """A model that cannot load fails before the tape is touched (--force would have removed
    the old one), with the file at fault named: a checked CheckpointError, one error line.
    The prompts are text, so a checkpoint needs its tokenizer.json."""
    from tokentape.engine.model_registry import ORACLE_MODELS

    if model in ORACLE_MODELS:
        return  # and the model package (torch) is not loaded for the oracle
    from tokentape.engine.model.loader import check_checkpoint_files
    from tokentape.engine.tokenizer import MissingTokenizer, checkpoint_tokenizer

    check_checkpoint_files(model)
    if not _has_random_weights(model) and isinstance(checkpoint_tokenizer(model), MissingTokenizer):
        raise CLIError(
            f"{os.path.join(model, 'tokenizer.json')}: missing; the prompts of "
            "`tokentape generate` are text, which this checkpoint cannot encode"
        )


def cmd_generate(args: argparse.Namespace) -> int:
    from tokentape import LLM, EngineConfig, SamplingParams

    prompts = _collect_prompts(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    EngineConfig(model=args.model, **engine_args_from_cli(args))  # bad engine arguments fail here
    _check_model(args.model)
    scenario = scenario_of(args)
    scenario.check_requests([str(i) for i in range(len(prompts))])
    tape = _tape_path(args)
    llm = LLM(args.model, tape=tape, **engine_args_from_cli(args))
    path = llm.tape_path
    try:
        outputs = llm.generate(prompts, params, scenario=scenario)
    except expected_errors() as exc:
        where = f" (the tape up to the failure is at {path})" if path else ""
        raise CLIError(f"{exc}{where}") from None
    except BaseException:
        if path:
            print(f"tape: {path} (recorded up to the failure)", file=sys.stderr)
        raise
    finally:
        llm.close()

    out = sys.stdout
    if not args.json and _has_random_weights(args.model):
        out.write(
            f"note: the built-in model {args.model!r} has random weights (drawn from the "
            "seed), so its text is noise; its token ids are shown beside it\n"
        )
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
            out.write(
                safe_text(
                    f"request {o.request_id}: finish_reason={c.finish_reason} "
                    f"num_tokens={len(c.token_ids)}\n"
                    f"  prompt:    {o.prompt!r}\n"
                    f"  token_ids: {c.token_ids}\n"
                    f"  text:      {c.text!r}\n"
                )
            )
    out.flush()
    warn_pending(scenario, llm.llm_engine.engine_core.state.step)
    print(f"tape: {path}" if path else "tape: none (--no-tape)", file=sys.stderr)
    return EXIT_OK
