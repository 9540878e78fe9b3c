"""Resume from tokens, as SkyRL and slime do around a weight sync: `pause_generation(mode=
"abort")` ends every rollout where it stands, the new weights come in (vLLM's chunked transfer:
start_weight_update, update_weights per chunk, finish_weight_update with a weight_version),
and each aborted rollout is re-submitted as its prompt plus the tokens it had so far
(token-in, token-out) to finish under the new weights. Every token says which weights
computed it (`CompletionOutput.weight_versions`).

Check: for every rollout, the tokens generated after the re-submit equal what a fresh engine
with the new weights gives from the same prefix (greedy). The built-in model drawn from two
seeds stands for the old and the new weights. Exit 0 when the check held, 1 otherwise.

    python examples/rl_resume_from_tokens.py                      # holds
    python examples/rl_resume_from_tokens.py --keep-prefix-cache --tape keep.tape
    tokentape postmortem keep.tape     # [warning] stale_prefix_hit_after_weight_update

With `--keep-prefix-cache` the pause keeps the prefix cache (clear_cache=False): each
re-submitted rollout then reuses KV blocks the old weights computed, so its continuation is
not the new weights' (the class of NeMo-RL #4018) and the check fails.
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
STEPS_BEFORE_SYNC = 6
NEW_VERSION = "step-1"


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def drive(engine: LLMEngine, rollouts: dict, max_steps: int | None = None) -> None:
    """Step, keeping each request's latest (cumulative) completion."""
    steps = 0
    while engine.has_unfinished_requests() and (max_steps is None or steps < max_steps):
        for out in engine.step():
            rollouts[out.request_id] = out.outputs[0]
        steps += 1


def sync_weights(engine: LLMEngine, weights: dict, chunk_size: int = 8) -> str:
    """vLLM's native transfer: the state dict in chunks, loaded at the finish."""
    engine.start_weight_update()
    names = list(weights)
    for i in range(0, len(names), chunk_size):
        engine.update_weights({n: weights[n] for n in names[i : i + chunk_size]})
    return engine.finish_weight_update(weight_version=NEW_VERSION)


def run(keep_prefix_cache: bool, depth: int, tape: str | None) -> list[str]:
    """One round; returns the mismatches (empty when the check held)."""
    llm = LLM(model="tiny", device="cpu", pipeline_depth=depth, tape=tape)
    engine = llm.llm_engine
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    rollouts: dict = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS))
    drive(engine, rollouts, STEPS_BEFORE_SYNC)
    # Abort every rollout; the aborted ones' last tokens come with the next step's outputs.
    engine.pause_generation(mode="abort", clear_cache=not keep_prefix_cache)
    drive(engine, rollouts, 1)
    so_far = {i: list(rollouts[f"r{i}"].token_ids) for i in range(len(prompts))}
    assert all(rollouts[f"r{i}"].finish_reason == "abort" for i in so_far)
    weights = builtin_model("tiny", seed=1)[1].state_dict()  # the trainer's new weights
    sync_weights(engine, weights)
    engine.resume_generation()
    for i, prompt in enumerate(prompts):  # token-in: the prompt plus the rollout so far
        engine.add_request(f"r{i}-resumed", prompt + so_far[i], greedy(MAX_TOKENS - len(so_far[i])))
    drive(engine, rollouts)
    llm.close()

    fresh = LLM(model="tiny", device="cpu", seed=1, tape=None)  # the new weights, from scratch
    mismatches = []
    for i, prompt in enumerate(prompts):
        resumed = rollouts[f"r{i}-resumed"]
        want = fresh.generate([prompt + so_far[i]], greedy(MAX_TOKENS - len(so_far[i])))
        expected = want[0].outputs[0].token_ids
        versions = ["default"] * len(so_far[i]) + resumed.weight_versions
        print(
            f"  rollout {i}: {versions.count('default')} tokens from the old weights, "
            f"{versions.count(NEW_VERSION)} from {NEW_VERSION}"
        )
        if resumed.token_ids != expected:
            first = next(j for j, (a, b) in enumerate(zip(resumed.token_ids, expected)) if a != b)
            mismatches.append(
                f"rollout {i}: re-submitted after {len(so_far[i])} tokens, it gives "
                f"{resumed.token_ids[first : first + 4]}... where a fresh engine with the new "
                f"weights gives {expected[first : first + 4]}... (from token {first})"
            )
    fresh.close()
    return mismatches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--keep-prefix-cache",
        action="store_true",
        help="pause with clear_cache=False: the re-submitted rollouts reuse old KV",
    )
    parser.add_argument("--pipeline-depth", type=int, default=2, choices=[1, 2, 3, 4])
    parser.add_argument("--tape", metavar="PATH", help="record the round on a tape")
    parser.add_argument("--force", action="store_true", help="overwrite an existing tape")
    args = parser.parse_args(argv)
    if args.tape and os.path.lexists(args.tape):
        if not args.force:
            parser.error(f"{args.tape}: the file exists; pass --force to overwrite it")
        remove_tape_files(args.tape)
    mismatches = run(args.keep_prefix_cache, args.pipeline_depth, args.tape)
    print(
        f"clear_cache={not args.keep_prefix_cache} pipeline_depth={args.pipeline_depth}: "
        + ("check held" if not mismatches else "CHECK FAILED")
    )
    for m in mismatches:
        print(f"  {m}")
    return 0 if not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
