"""The RLHF loop on Ray: a trainer actor and N tokentape engine actors (AsyncLLM, each with its
engine core process and its own tape), as vLLM's RLHF example runs vLLM under Ray.

Each iteration: every engine starts its rollouts; once each of its rollouts has a few tokens
the engine runs pause_generation(mode="keep", clear_cache=True) at once, so every rollout is
paused mid-generation; the trainer makes a deterministic weight update from those first
tokens; the new weights reach the engines through Ray's object store (default), a
torch.distributed broadcast (gloo, the CPU backend) to the engine actors, or, as OpenRLHF and
verl do, a broadcast received inside each engine's worker by the trainer's own code: a worker
extension (examples/rlhf_weight_sync.py) that collective_rpc calls; every engine runs
resume_generation() and finishes its rollouts with the new weights. Then the LoRA rollout
step: the trainer writes the iteration's LoRA adapter (a PEFT folder) and every engine runs
a batch of rollouts with it (LoRARequest). Check: every engine reports the trainer's weights,
for every request the tokens after the resume equal what a fresh engine with the new weights
gives when it continues from the same prefix (prompt plus the tokens delivered before the
pause), and the LoRA rollouts equal a fresh engine's with the same weights and adapter. Exit 0
when it held for every engine and iteration, 1 otherwise. Under `--discard-policy flag` (vLLM
before #42117) with async scheduling (pipeline depth >= 2) it fails as vLLM #42043 did: the
first valid token after the resume is thrown away and every later one shifts.

    python examples/rlhf_ray.py                                  # 2 engines, 2 iterations: holds
    python examples/rlhf_ray.py --discard-policy flag            # fails
    python examples/rlhf_ray.py --weight-sync broadcast          # torch.distributed, gloo
    python examples/rlhf_ray.py --weight-sync collective-rpc     # a worker extension receives it
    python examples/rlhf_ray.py --tape-dir tapes && tokentape postmortem tapes
    python examples/rlhf_ray.py --tape-dir tapes --kill-engine 1 # failure drill (ray.kill)
    python examples/rlhf_ray.py --tape-dir tapes --kill-engine 1 --kill-how sigkill

Needs the ray extra (pip install 'tokentape[ray]'); the engine actors use the serve extra's
pyzmq. `--address` joins a running Ray cluster instead of starting one (the tape directory
must then be on storage every node sees).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import time
from typing import Any

import ray
from rlhf_ray_actors import (
    LORA_RANK,
    TOKENS_BEFORE_UPDATE,
    EngineWorker,
    Trainer,
    lora_request,
    lora_request_specs,
    request_specs,
    sampling_params,
)

from tokentape import LLM, SamplingParams
from tokentape.events.discard import DISCARD_POLICIES
from tokentape.events.sqlite_reader import tape_file_status

KILLED_ROLLOUT_SCALE = 16  # the doomed engine's rollouts: 1,024-8,192 tokens
WRITER_WAIT_S = 30.0  # how long a killed engine's tape may take to be finished (its writer)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engines", type=int, default=2, help="engine actors (default 2)")
    p.add_argument("--iterations", type=int, default=2, help="RL iterations (default 2)")
    p.add_argument("--discard-policy", default="epoch", choices=sorted(DISCARD_POLICIES))
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM's async scheduling (default on; off means pipeline depth 1)",
    )
    p.add_argument(
        "--pipeline-depth",
        type=int,
        default=2,
        choices=[1, 2, 3, 4],
        help="steps in flight with async scheduling (default 2, vLLM's)",
    )
    p.add_argument(
        "--weight-sync",
        default="object-store",
        choices=["object-store", "broadcast", "collective-rpc"],
        help="how the weights reach the engines: Ray's object store (default), a "
        "torch.distributed broadcast from the trainer (gloo) to the engine actors, or one "
        "received in each engine's worker by a worker extension through collective_rpc",
    )
    p.add_argument(
        "--lora-rollouts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after each iteration's rollouts, a LoRA rollout step with the trainer's "
        "adapter of that iteration (default on)",
    )
    p.add_argument(
        "--tape-dir",
        metavar="DIR",
        default=None,
        help="record one tape per engine, DIR/engine-<i>.tape (default: in memory)",
    )
    p.add_argument(
        "--kill-engine",
        metavar="I",
        type=int,
        default=None,
        help="failure drill: kill engine I in the middle of the first iteration's "
        "rollouts; the loop goes on with the others (object-store sync only)",
    )
    p.add_argument(
        "--kill-how",
        default="ray.kill",
        choices=["ray.kill", "sigkill"],
        help="ray.kill (Ray kills the actor and its engine core process; the tape "
        "stops mid-run) or sigkill (the actor's process dies alone, as by the OOM "
        "killer; its engine core records that on the tape)",
    )
    p.add_argument(
        "--address", default=None, help="a Ray cluster to join (default: start one here)"
    )
    p.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="CPUs of the local Ray instance (default: one per engine, at least 2)",
    )
    args = p.parse_args(argv)
    if args.engines < 1 or args.iterations < 1:
        p.error("--engines and --iterations must be >= 1")
    if args.kill_engine is not None:
        if not 0 <= args.kill_engine < args.engines or args.engines < 2:
            p.error("--kill-engine needs an engine index in [0, --engines) and another engine left")
        if args.weight_sync != "object-store":
            p.error(
                "--kill-engine needs --weight-sync object-store "
                "(a broadcast group cannot lose a member)"
            )
    return args


def tape_paths(tape_dir: str | None, n: int) -> list[str | None]:
    if tape_dir is None:
        return [None] * n
    os.makedirs(tape_dir, exist_ok=True)
    paths = [os.path.join(tape_dir, f"engine-{i}.tape") for i in range(n)]
    taken = [p for p in paths if os.path.exists(p)]
    if taken:
        raise SystemExit(f"error: {taken[0]}: a tape already exists here; choose a new --tape-dir")
    return list(paths)


def check_against_fresh_engine(
    weights: dict[str, Any],
    trainer_id: str,
    got_ids: dict[int, str],
    cases: list[tuple[int, str, list[int], SamplingParams, list[int], list[int]]],
) -> list[str]:
    """A fresh engine with the trainer's weights continues every request from its prefix;
    the tokens each engine delivered after the resume must be exactly those."""
    problems = [
        f"engine {i} serves weights {wid[:20]}..., the trainer made {trainer_id[:20]}..."
        for i, wid in got_ids.items()
        if wid != trainer_id
    ]
    fresh = LLM(model="tiny", device="cpu", pipeline_depth=1, tape=False)
    try:
        fresh.llm_engine.pause_generation(mode="keep", clear_cache=False)
        fresh_id = fresh.llm_engine.update_weights(weights)
        fresh.llm_engine.resume_generation()
        if fresh_id != trainer_id:
            problems.append(
                f"the fresh engine hashes the trainer's weights as {fresh_id}, not {trainer_id}"
            )
        todo = [c for c in cases if len(c[4]) < c[3].max_tokens]
        conts = [
            SamplingParams(
                max_tokens=p.max_tokens - len(prefix),
                temperature=p.temperature,
                top_p=p.top_p,
                seed=p.seed,
                ignore_eos=True,
            )
            for _, _, _, p, prefix, _ in todo
        ]
        outs = (
            fresh.generate([prompt + prefix for _, _, prompt, _, prefix, _ in todo], conts)
            if todo
            else []
        )
    finally:
        fresh.close()
    for (engine, req_id, _, _, prefix, after), out in zip(todo, outs):
        expected = out.outputs[0].token_ids
        if after != expected:
            at = next(
                (j for j, (a, b) in enumerate(zip(after, expected)) if a != b),
                min(len(after), len(expected)),
            )
            problems.append(
                f"engine {engine} request {req_id}: after {len(prefix)} tokens, resumed "
                f"{after[at : at + 4]}... where a fresh engine gives {expected[at : at + 4]}... "
                f"(from token {at} after the resume)"
            )
    return problems


def check_lora_rollouts(
    weights: dict[str, Any],
    lora_path: str,
    iteration: int,
    specs: dict[int, list[Any]],
    got: dict[int, dict[str, list[int]]],
) -> list[str]:
    """A fresh engine with the trainer's weights and the iteration's adapter runs the LoRA
    rollouts; every engine's tokens must be exactly those."""
    fresh = LLM(model="tiny", device="cpu", tape=False, enable_lora=True)
    problems = []
    try:
        fresh.llm_engine.pause_generation(mode="keep", clear_cache=False)
        fresh.llm_engine.update_weights(weights)
        fresh.llm_engine.resume_generation()
        lora = lora_request(iteration, lora_path)
        for i, engine_specs in specs.items():
            outs = fresh.generate(
                [prompt for _, prompt, _ in engine_specs],
                [sampling_params(kw) for _, _, kw in engine_specs],
                use_tqdm=False,
                lora_request=lora,
            )
            for (req_id, _, _), out in zip(engine_specs, outs):
                if got[i][req_id] != out.outputs[0].token_ids:
                    problems.append(
                        f"engine {i} LoRA rollout {req_id}: {got[i][req_id][:4]}... where a "
                        f"fresh engine with adapter {lora.lora_name} gives "
                        f"{out.outputs[0].token_ids[:4]}..."
                    )
    finally:
        fresh.close()
    return problems


def kill(actor: Any, how: str) -> None:
    """ray.kill, or a SIGKILL the actor sends itself; neither waits for the death."""
    if how == "ray.kill":
        ray.kill(actor)
    else:
        actor.crash.remote()


def wait_for_tape_writer(path: str | None) -> None:
    """A killed engine's tape is finished by its tape writer (which drains what it was handed)
    or, when only the actor died, by its engine core (which records that)."""
    deadline = time.monotonic() + WRITER_WAIT_S
    while path is not None and not tape_file_status(path).finished and time.monotonic() < deadline:
        time.sleep(0.05)


def run(args: argparse.Namespace) -> int:
    paths = tape_paths(args.tape_dir, args.engines)
    engine_args: dict[str, Any] = {
        "async_scheduling": args.async_scheduling,
        "pipeline_depth": args.pipeline_depth,
        "discard_policy": args.discard_policy,
        "device": "cpu",
    }
    if args.weight_sync == "collective-rpc":
        engine_args["worker_extension_cls"] = "rlhf_weight_sync.WeightSyncExtension"
    if args.lora_rollouts:  # the adapter of each iteration replaces the one before
        engine_args.update(enable_lora=True, max_lora_rank=LORA_RANK, max_cpu_loras=2)
    # The adapters stay beside the tapes: a what-if with the model loads them from there.
    lora_folder = (
        os.path.join(args.tape_dir, "lora-adapters")
        if args.tape_dir
        else tempfile.mkdtemp(prefix="rlhf_lora_")
    )
    # (mypy does not see what @ray.remote adds to a class)
    trainer = Trainer.remote()  # type: ignore[attr-defined]
    engines = {i: EngineWorker.remote(i, paths[i], engine_args) for i in range(args.engines)}  # type: ignore[attr-defined]
    broadcast = args.weight_sync in ("broadcast", "collective-rpc")
    in_worker = args.weight_sync == "collective-rpc"
    held = True
    try:
        if broadcast:  # the trainer is rank 0 of a gloo group with every engine
            address = ray.get(trainer.group_address.remote())
            world = args.engines + 1
            ray.get(
                [trainer.join_group.remote(address, 0, world)]
                + [
                    e.collective_rpc.remote("init_weight_update_group", [address, i + 1, world])
                    if in_worker
                    else e.join_group.remote(address, i + 1, world)
                    for i, e in engines.items()
                ]
            )
        for it in range(args.iterations):
            doomed = args.kill_engine if it == 0 else None
            # The doomed engine's rollouts are long enough that the kill, which does not wait
            # for the death, lands while they run (512 tokens of tiny take under a second).
            specs = {
                i: request_specs(i, it, KILLED_ROLLOUT_SCALE if i == doomed else 1) for i in engines
            }
            # Each engine pauses itself once every rollout of its has its first tokens, watched
            # from the call that starts them: no round trip (no trainer's step, no second call)
            # in between, so they are mid-generation at the pause on a busy machine too.
            ray.get(
                [
                    e.start.remote(specs[i], None if i == doomed else TOKENS_BEFORE_UPDATE)
                    for i, e in engines.items()
                ]
            )
            pausing = {i: e.paused.remote() for i, e in engines.items() if i != doomed}
            first: dict[int, dict[str, list[int]]] = {}
            if doomed is not None:
                # Mid-rollout, its requests running (never paused); no wait for the death.
                first[doomed] = ray.get(engines[doomed].wait_tokens.remote())
                kill(engines.pop(doomed), args.kill_how)
            prefixes: dict[int, dict[str, int]] = {}
            for i, (tokens, at_pause) in zip(pausing, ray.get(list(pausing.values()))):
                first[i], prefixes[i] = tokens, at_pause
            rollouts = [first[i] for i in sorted(first)]
            trainer_id = ray.get(trainer.train_step.remote(it, rollouts))  # the engines wait paused
            if broadcast:
                meta = ray.get(trainer.weight_meta.remote())
                got = ray.get(
                    [trainer.broadcast.remote()]
                    + [
                        e.collective_rpc.remote("update_weights_from_trainer", [meta])
                        if in_worker
                        else e.receive_weights.remote(meta)
                        for e in engines.values()
                    ]
                )[1:]
            else:
                weights_ref = trainer.state_dict.remote()  # put once, read by every engine
                got = ray.get([e.update_weights.remote(weights_ref) for e in engines.values()])
            ray.get([e.resume.remote() for e in engines.values()])
            streams = dict(zip(engines, ray.get([e.finish.remote() for e in engines.values()])))
            cases = []
            for i, reqs in specs.items():
                if i in engines:
                    for req_id, prompt, kw in reqs:
                        n = prefixes[i][req_id]
                        tokens = streams[i][req_id]
                        cases.append(
                            (i, req_id, prompt, sampling_params(kw), tokens[:n], tokens[n:])
                        )
            mid = [c for c in cases if 0 < len(c[4]) < c[3].max_tokens]
            resumed = len(mid)
            problems = check_against_fresh_engine(
                ray.get(trainer.state_dict.remote()), trainer_id, dict(zip(engines, got)), cases
            )
            for i in sorted(set(engines) - {c[0] for c in mid}):
                problems.append(
                    f"engine {i}: no request was mid-generation at the pause: nothing "
                    "was checked across the update (a machine too busy? lengthen "
                    "ROLLOUT_TOKENS)"
                )
            print(
                f"iteration {it}: {len(engines)} engines, {len(cases)} requests ({resumed} paused "
                f"mid-generation), weights {trainer_id[:19]}... via {args.weight_sync}: "
                f"{'check held' if not problems else 'CHECK FAILED'}"
            )
            for problem in problems:
                print(f"  {problem}")
            held &= not problems
            if args.lora_rollouts:
                lora_path = ray.get(trainer.save_lora_adapter.remote(it, lora_folder))
                lora_specs = {i: lora_request_specs(i, it) for i in engines}
                lora_tokens = dict(
                    zip(
                        engines,
                        ray.get(
                            [
                                e.lora_rollouts.remote(lora_specs[i], lora_path, it)
                                for i, e in engines.items()
                            ]
                        ),
                    )
                )
                problems = check_lora_rollouts(
                    ray.get(trainer.state_dict.remote()), lora_path, it, lora_specs, lora_tokens
                )
                print(
                    f"iteration {it}: LoRA rollouts with {os.path.basename(lora_path)} on "
                    f"{len(engines)} engines: {'check held' if not problems else 'CHECK FAILED'}"
                )
                for problem in problems:
                    print(f"  {problem}")
                held &= not problems
            if args.kill_engine is not None and it == 0:
                wait_for_tape_writer(paths[args.kill_engine])
                print(
                    f"engine {args.kill_engine} killed ({args.kill_how}) mid-rollout; "
                    f"its tape: {paths[args.kill_engine] or '(in memory, lost)'}"
                )
    finally:
        for e in engines.values():
            with contextlib.suppress(ray.exceptions.RayActorError):  # one that died on its own
                ray.get(e.shutdown.remote())  # closes its tape
        for actor in [*engines.values(), trainer]:
            ray.kill(actor)
    if args.tape_dir:
        print(f"tapes: {args.tape_dir} (tokentape postmortem {args.tape_dir})")
    return 0 if held else 1


def runtime_env() -> dict[str, Any]:
    """examples/ on the actors' PYTHONPATH: the engine core processes they start import the
    worker extension (rlhf_weight_sync) by name."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = not ray.is_initialized()
    if started:
        if args.address:
            ray.init(address=args.address, logging_level=logging.WARNING, runtime_env=runtime_env())
        else:
            ray.init(
                num_cpus=args.num_cpus or max(2, args.engines),
                include_dashboard=False,
                logging_level=logging.WARNING,
                runtime_env=runtime_env(),
            )
    try:
        return run(args)
    finally:
        if started:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
