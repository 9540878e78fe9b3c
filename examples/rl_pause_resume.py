"""The RLHF loop of vLLM issue #42043, on the built-in model: generate with async scheduling,
pause(keep, clear_cache=True) mid-generation, update the weights, resume.

Check: for every request, the tokens delivered after resume equal what a fresh engine with the
new weights produces when it continues from the same prefix (prompt plus the tokens delivered
before the update). It runs for pipeline depths 1, 2 and 3 and exits 0 when the check held for
all of them, 1 otherwise. With `--discard-policy flag` (vLLM before #42117) it fails as #42043
did at depth >= 2: the first valid token after resume is thrown away and the rest shift by one.

    python examples/rl_pause_resume.py                        # epoch (default): holds
    python examples/rl_pause_resume.py --discard-policy flag  # fails at depth 2 and 3

With `--tape PATH` each round is recorded (PATH for one depth, PATH's name with -depthN for
several; an existing file is refused unless --force), so a failed round can be replayed:

    python examples/rl_pause_resume.py --discard-policy flag --pipeline-depth 2 --tape rl.tape
    tokentape postmortem rl.tape                              # names vLLM #42043
"""

from __future__ import annotations

import argparse
import os
import sys

from tokentape import LLM, SamplingParams
from tokentape.engine.llm_engine import LLMEngine
from tokentape.engine.model.loader import builtin_model
from tokentape.events.sqlite_store import remove_tape_files

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 5, 8,"]
MAX_TOKENS = 24
STEPS_BEFORE_PAUSE = 6


def params(i: int) -> SamplingParams:
    # Seeded sampling and greedy mixed: a seeded draw is keyed by (seed, position), so a fresh
    # engine continuing from the same prefix draws the same tokens.
    if i % 2:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=100 + i, ignore_eos=True
    )


def new_weights() -> dict:
    """The "trained" weights: the built-in model drawn from another seed."""
    return builtin_model("tiny", seed=1)[1].state_dict()


def collect(engine: LLMEngine, tokens: dict[str, list[int]], max_steps: int | None = None) -> None:
    steps = 0
    while engine.has_unfinished_requests() and (max_steps is None or steps < max_steps):
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids  # cumulative: every token so far
        steps += 1


def run(depth: int, discard_policy: str, device: str = "cpu", tape: str | None = None) -> list[str]:
    """One RL round; returns the mismatches (empty when the check held)."""
    llm = LLM(
        model="tiny", device=device, pipeline_depth=depth, discard_policy=discard_policy, tape=tape
    )
    engine = llm.llm_engine
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params(i))
        tokens[str(i)] = []
    collect(engine, tokens, STEPS_BEFORE_PAUSE)
    engine.pause_generation(mode="keep", clear_cache=True)  # drains the steps in flight
    collect(engine, tokens, 1)  # delivers what the drain produced; nothing is scheduled
    prefixes = {req_id: list(t) for req_id, t in tokens.items()}
    weights = new_weights()
    engine.update_weights(weights)
    engine.resume_generation()
    collect(engine, tokens)
    llm.close()

    # A fresh engine with the new weights continues each request from the same prefix.
    fresh = LLM(model="tiny", device=device, pipeline_depth=1, tape=None)
    fresh.llm_engine.pause_generation(mode="keep", clear_cache=False)
    fresh.llm_engine.update_weights(weights)
    fresh.llm_engine.resume_generation()
    mismatches = []
    for i, prompt in enumerate(prompts):
        req_id = str(i)
        prefix, after = prefixes[req_id], tokens[req_id][len(prefixes[req_id]) :]
        remaining = MAX_TOKENS - len(prefix)
        if remaining <= 0:
            continue
        p = params(i)
        cont = SamplingParams(
            max_tokens=remaining,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            ignore_eos=True,
        )
        expected = fresh.generate([prompt + prefix], cont)[0].outputs[0].token_ids
        if after != expected:
            first = next(
                (j for j, (a, b) in enumerate(zip(after, expected)) if a != b),
                min(len(after), len(expected)),
            )
            mismatches.append(
                f"request {req_id}: after {len(prefix)} tokens, "
                f"resumed {after[first : first + 4]}... "
                f"where a fresh engine gives {expected[first : first + 4]}... "
                f"(from token {first} after resume)"
            )
    fresh.close()
    return mismatches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--discard-policy", default="epoch", choices=["epoch", "counter", "flag"])
    parser.add_argument(
        "--pipeline-depth",
        type=int,
        action="append",
        choices=[1, 2, 3, 4],
        help="pipeline depth to check (repeatable; default 1, 2 and 3)",
    )
    parser.add_argument(
        "--tape",
        metavar="PATH",
        help="record each round on a tape: PATH for one pipeline depth, PATH with -depthN "
        "before .tape for several",
    )
    parser.add_argument("--force", action="store_true", help="overwrite existing tape files")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the model runs (default cpu: float32 and batch-invariant, so the check is "
        "exact; on cuda in bfloat16 a batched run may differ from the fresh one in the last "
        "bits, and a near-tie can then flip a token)",
    )
    args = parser.parse_args(argv)
    depths = args.pipeline_depth or [1, 2, 3]
    tapes = tape_paths(args.tape, depths)
    for path in tapes.values():  # every tape is checked before the first round runs
        if path is not None and os.path.lexists(path):
            if not args.force:
                parser.error(f"{path}: the file exists; pass --force to overwrite it")
            remove_tape_files(path)
    held = True
    for depth in depths:
        mismatches = run(depth, args.discard_policy, args.device, tapes[depth])
        print(
            f"pipeline_depth={depth} discard_policy={args.discard_policy}: "
            f"{'check held' if not mismatches else 'CHECK FAILED'}"
            + (f" (tape: {tapes[depth]})" if tapes[depth] else "")
        )
        for m in mismatches:
            print(f"  {m}")
        held &= not mismatches
    return 0 if held else 1


def tape_paths(tape: str | None, depths: list[int]) -> dict[int, str | None]:
    if tape is None or len(depths) == 1:
        return {d: tape for d in depths}
    stem = tape.removesuffix(".tape")
    return {d: f"{stem}-depth{d}.tape" for d in depths}


if __name__ == "__main__":
    sys.exit(main())
