"""vLLM's own scheduler, recorded, driven as vLLM's engine core drives it, with tokentape's
oracle as the model: the async path that vLLM's CPU engine cannot run end to end, and what a
chaos storm against vLLM runs (tokentape/chaos/vllm_storms.py).

vLLM 0.32.0's CPU platform turns async scheduling off (vllm/platforms/cpu.py), so on a CPU
vLLM's AsyncScheduler runs only under a driver of its own. This one builds the scheduler as
EngineCore builds it, from `scheduler_cls` (tokentape's RecordingScheduler, which picks its
AsyncScheduler subclass for an async config), with a KV cache of `num_blocks` blocks and no
model, and repeats EngineCore's loop: `step_with_batch_queue` (a batch queue of depth 2: the
next step is scheduled before the previous one's output is applied) or `step`. The runner's
output for a sampling entry is the oracle's token at the position after the entry's tokens
(a pure function of prompt and position: any correct schedule delivers the oracle's stream).
Commands between steps as EngineCore issues them: aborts (`finish_requests`),
`reset_prefix_cache(reset_running_requests=...)` with steps in flight, pauses as
`pause_scheduler` makes them (pause state, drain the queue, reset the caches when asked),
and sleeps and wake-ups through the release's own EngineCore.sleep / wake_up and
Executor.sleep / wake_up (_engine_core), which the recorder hears of through the
executor's call to its workers.

Runs in vLLM's Python with tokentape importable:

    python -m tokentape.integrations.vllm.scheduler_driver SPEC.json...   # each spec in turn
    python -m tokentape.integrations.vllm.scheduler_driver SPEC.json --tape new.tape
    python -m tokentape.integrations.vllm.scheduler_driver --serve        # specs on stdin

`--serve` says {"ready": version} once vLLM is imported, then reads one spec (JSON) per line
and answers each with one result line on the stdout it was started with (vLLM's own output
goes to stderr): vLLM is imported once, however many specs follow (a chaos campaign, a
shrink).

Spec: {"model": folder (its config.json shapes the KV spec), "tape", "async": bool,
"num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
"requests": [{"id", "prompt", "max_tokens", "add_at"}], "reset_at": [step, or [step,
reset_running_requests]] (a bare step resets running requests), "pause_at": [[step, mode,
clear_cache]], "abort_at": [[step, id]], "sleep_at": [[step, level, mode]] (vLLM's own
EngineCore.sleep: its pause, then the executor's memory released at level 1 or 2; level 0
pauses only), "wake_at": [[step, tags or null]] (its EngineCore.wake_up: tags among
"weights", "kv_cache", "scheduling"), "num_speculative_tokens": k (n-gram drafts: the model
accepts a seeded random number of them), "seed", "check": bool (the recorder checks each event
against the fold of the tape as it records: $TOKENTAPE_CHECK), "tape_at_close": bool (the tape
is written once, at the end: $TOKENTAPE_TAPE_AT_CLOSE), "out": the result's file (without it,
stdout)}. The result:
{"outputs": {id: {"tokens", "finish_reason"}}, "scheduler": class name, "vllm": version,
"steps": engine steps between commands (the commands' clock), "drain_steps": engine steps
inside pauses, "scheduled_steps": steps that ran tokens, "seconds": wall time of the
stepping, "hung": [ids], "stopped": null | "idle" | "step_limit", "error": null | "Type:
message (at file:line in function)"}. Where requests remain but HUNG_AFTER engine steps in a
row run nothing (vLLM 0.20's #42043 leaves a request whose placeholders block it for ever),
during a pause's drain too, the run stops there ("idle"); after MAX_STEPS engine steps it
stops however busy ("step_limit").
An exception from vLLM or the recorder once the scheduler is built ends the run with "error"
(the tape ends with it); one while building it is a "setup_error" (the release cannot run).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import random
import sys
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

RECORDER = "tokentape.integrations.vllm.RecordingScheduler"
HUNG_AFTER = 100  # engine steps in a row that run nothing while requests remain: a hang
MAX_STEPS = 20_000  # engine steps of one run, whatever it does (a livelock stops here)


class SetupError(RuntimeError):
    """The scheduler could not be built: this vLLM cannot run the spec at all."""


@contextlib.contextmanager
def _scheduler_only_platform() -> Iterator[None]:
    """While the config is built: the CPU platform's check that an x86 CPU has Triton with
    a CPU backend (vLLM 0.34 on, for its model runner's kernels) passes. The driver builds
    the scheduler and its KV cache manager only, never a worker, a model runner or a kernel,
    so the check guards nothing it runs; everything else the platform decides for the config
    (block size, async scheduling, which the driver then sets) is decided as on a machine
    with triton-cpu. Releases without the check are untouched."""
    try:
        import vllm.triton_utils as triton_utils
    except ImportError:  # a release without the module has no such check
        yield
        return
    had = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = had


def _build(spec: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """(the recording scheduler, the request block hasher, the reset's keyword arguments)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    if spec.get("tape"):
        os.environ["TOKENTAPE_TAPE"] = spec["tape"]
    else:  # the recorder must refuse to start without a tape path
        os.environ.pop("TOKENTAPE_TAPE", None)
    os.environ["TOKENTAPE_CHECK"] = "1" if spec.get("check") else "0"
    os.environ["TOKENTAPE_TAPE_AT_CLOSE"] = "1" if spec.get("tape_at_close") else "0"
    block_size, num_blocks = spec["block_size"], spec["num_blocks"]
    k = spec.get("num_speculative_tokens", 0)
    speculative = SpeculativeConfig(model="ngram", num_speculative_tokens=k) if k else None
    with _scheduler_only_platform():
        vllm_config = VllmConfig(
            speculative_config=speculative,
            scheduler_config=SchedulerConfig(
                max_num_seqs=spec["max_num_seqs"],
                max_num_batched_tokens=spec["max_num_batched_tokens"],
                max_model_len=spec["max_model_len"],
                is_encoder_decoder=False,
                scheduler_cls=RECORDER,
            ),
            model_config=ModelConfig(
                model=spec["model"],
                dtype="float32",
                seed=0,
                skip_tokenizer_init=True,
                max_model_len=spec["max_model_len"],
            ),
            cache_config=CacheConfig(block_size=block_size),
        )
    # The CPU platform has just turned async scheduling off; a GPU platform leaves it on.
    vllm_config.scheduler_config.async_scheduling = spec["async"]
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    with open(os.path.join(spec["model"], "config.json")) as f:
        hf = json.load(f)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layers"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=hf["num_key_value_heads"],
                    head_size=hf["head_dim"],
                    dtype=torch.float32,
                ),
            )
        ],
    )
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    sched = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=block_size,
        log_stats=False,
    )
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn)
    # vLLM's pause(clear_cache) resets the connector too since 0.2x; 0.20 resets the prefix
    # cache alone (and with no connector, a connector reset reads as a failed reset).
    reset_kwargs: dict[str, Any] = {"reset_running_requests": True}
    if "reset_connector" in inspect.signature(EngineCore._reset_caches).parameters:
        reset_kwargs["reset_connector"] = True
    return sched, hasher, reset_kwargs


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one spec to its end (or its hang, or vLLM's exception); raises SetupError when the
    scheduler cannot be built."""
    import vllm

    try:
        sched, hasher, reset_kwargs = _build(spec)
    except Exception as exc:
        raise SetupError(f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc
    driver = _Driver(spec, sched, hasher, reset_kwargs)
    start = time.perf_counter()
    error = None
    try:
        driver.run()
    except Exception as exc:  # vLLM's, or the recorder's (its live checks): on the tape
        error = _describe(exc)
    seconds = time.perf_counter() - start
    try:
        sched.shutdown()  # closes the tape
    except Exception as exc:
        error = error or f"{type(exc).__name__} at shutdown: {' '.join(str(exc).split())}"
    return {
        "outputs": driver.outputs,
        "scheduler": type(sched).__name__,
        "vllm": vllm.__version__,
        "steps": driver.step,
        "drain_steps": driver.drain_steps,
        "scheduled_steps": driver.scheduled_steps,
        "seconds": seconds,
        "hung": driver.hung,
        "stopped": driver.stopped,
        "error": error,
    }


def _describe(exc: BaseException) -> str:
    """`Type: message (at file:line in function)`, the frame that raised it: an assert of
    vLLM's has no message, its place says which one it is."""
    import traceback

    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        where = "/".join(last.filename.split(os.sep)[-3:])
        text += f" (at {where}:{last.lineno} in {last.name})"
    return text


class _Driver:
    """EngineCore's loop over one scheduler, with the spec's commands between its steps."""

    def __init__(
        self, spec: dict[str, Any], sched: Any, hasher: Any, reset_kwargs: dict[str, Any]
    ) -> None:
        import dataclasses

        from vllm.v1.outputs import ModelRunnerOutput

        from tokentape.engine.runners.oracle import OracleRunner

        fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
        self.with_index = "req_id_to_index" in fields
        self.spec, self.sched, self.hasher, self.reset_kwargs = spec, sched, hasher, reset_kwargs
        self.oracle = OracleRunner(cyclic=True, seed=0)
        self.keys: dict[str, int] = {}
        self.outputs: dict[str, dict[str, Any]] = {}
        self.queue: deque[tuple[Any, Any]] = deque()
        self.depth = 2 if spec["async"] else 1
        # The model, as the device sees each sequence: the position of its next sampled token
        # and the epoch it was computed in. Under async scheduling with drafts the scheduler
        # counts every draft as accepted until the output comes back, while the device
        # continues from what was accepted (vLLM's runner corrects the positions); a dropped
        # token was still used.
        self.next_position: dict[str, tuple[int, int]] = {}
        self.accept = random.Random(spec.get("seed", 0))
        self.step = self.drain_steps = self.scheduled_steps = self.idle = 0
        self.hung: list[str] = []
        self.stopped: str | None = None
        self.core: Any = None  # vLLM's EngineCore (_engine_core), with sleeps or wake-ups

    def run_model(self, out: Any) -> Any:
        """The runner's output for a step, computed as it is scheduled (the device runs it)."""
        from vllm.v1.outputs import ModelRunnerOutput

        before = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        ids = list(out.num_scheduled_tokens)
        tokens = []
        for r in ids:
            req = self.sched.requests[r]
            if req.is_prefill_chunk:
                tokens.append([])
                continue
            n, drafts = (
                out.num_scheduled_tokens[r],
                len(out.scheduled_spec_decode_tokens.get(r, ())),
            )
            position, epoch = self.next_position.get(r, (-1, -1))
            admitted = epoch != req.num_preemptions
            if admitted or not drafts:  # a prefill, or a decode without drafts
                position = before[r] + n - drafts
            # An admitted request has no drafts on the device: the scheduler's -1 padding to
            # the uniform decode size (vLLM 0.26 on) is rejected, as any wrong draft.
            accepted = 0 if admitted else self.accept.randint(0, drafts)
            key = self.keys[r]
            tokens.append([self.oracle.token_at(key, position + i) for i in range(accepted + 1)])
            self.next_position[r] = (position + accepted + 1, req.num_preemptions)
        if self.with_index:  # before vLLM 0.34 the output also carries its index
            return ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=tokens,
            )
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=tokens)

    def sleeping_memory(self) -> set[str]:
        """What the executor has released and not woken (its sleeping_tags)."""
        return self.core.model_executor.sleeping_tags if self.core is not None else set()

    def apply_oldest(self) -> bool:
        """Apply the oldest step's output; whether that step ran anything."""
        out, model_output = self.queue.popleft()
        for eco in self.sched.update_from_output(out, model_output).values():
            for o in eco.outputs:
                got = self.outputs.setdefault(o.request_id, {"tokens": [], "finish_reason": None})
                got["tokens"] += list(o.new_token_ids)
                if o.finish_reason is not None:
                    got["finish_reason"] = str(o.finish_reason)
        return bool(out.total_num_scheduled_tokens > 0)

    def schedule(self) -> bool:
        """Schedule one step; whether the model would have run it."""
        out = self.sched.schedule()
        if out.total_num_scheduled_tokens > 0 and "kv_cache" in self.sleeping_memory():
            fault = DeviceFault(
                "illegal memory access: the step writes the KV cache, which the sleep "
                "released and the wake-up left asleep"
            )
            self.sched.executor_failed(fault)
            raise fault
        self.queue.append((out, self.run_model(out)))
        ran = out.total_num_scheduled_tokens > 0
        self.scheduled_steps += ran
        return bool(ran)

    def engine_step(self) -> bool:
        """EngineCore.step (depth 1) or step_with_batch_queue (depth 2); whether a step that
        ran anything was scheduled or came back."""
        sched, queue = self.sched, self.queue
        executed = False
        if sched.has_requests():
            executed = self.schedule()
            if len(queue) < self.depth and (executed or sched.has_requests()):
                return executed
        elif not queue:
            return False
        return self.apply_oldest() or executed

    def aborted(self, requests: list[Any]) -> None:
        """What their clients get: vLLM's front end finishes a request it aborts itself, and
        the engine core sends the others an abort output."""
        for r in requests:  # Requests, or (id, client index) pairs before vLLM 0.26
            rid = r[0] if isinstance(r, tuple) else r.request_id
            self.outputs.setdefault(rid, {"tokens": [], "finish_reason": None})["finish_reason"] = (
                "abort"
            )

    def tick(self, busy: bool, draining: bool = False) -> bool:
        """Count an engine step; whether the run must stop here (a hang, or the step limit).
        A pause's drain steps do not move the commands' clock (`step`)."""
        if draining:
            self.drain_steps += 1
        else:
            self.step += 1
        self.idle = 0 if busy else self.idle + 1
        if self.idle >= HUNG_AFTER:  # EngineCore would spin here for ever
            self.stopped = "idle"
        elif self.step + self.drain_steps >= MAX_STEPS:
            self.stopped = "step_limit"
        else:
            return False
        self.hung = sorted(
            r for r in self.keys if self.outputs.get(r, {}).get("finish_reason") is None
        )
        return True

    def drain(self) -> bool:
        """Step until the engine has no work (a pause completes then); False on a hang."""
        while self.queue or self.sched.has_requests():
            if self.tick(self.engine_step(), draining=True):
                return False
        return True

    def add(self, r: dict[str, Any]) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        from tokentape.events.schema import SamplingParams as TapeParams

        params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0)
        self.keys[r["id"]] = self.oracle.request_key(r["prompt"], TapeParams())
        self.sched.add_request(
            Request(
                request_id=r["id"],
                prompt_token_ids=r["prompt"],
                sampling_params=params,
                pooling_params=None,
                block_hasher=self.hasher,
            )
        )

    def pause(self, mode: str, clear_cache: bool) -> bool:
        """EngineCore.pause_scheduler, completed: the pause state, aborts in mode abort, the
        drain (the pause completes once the engine has no work), then the caches reset when
        asked. False on a hang."""
        from vllm.v1.core.sched.interface import PauseState
        from vllm.v1.request import RequestStatus

        sched = self.sched
        if mode == "abort":
            self.aborted(sched.finish_requests(None, RequestStatus.FINISHED_ABORTED))
        sched.set_pause_state(PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW)
        if not self.drain():
            return False
        if clear_cache:  # EngineCore._reset_caches, as this release has it
            sched.reset_prefix_cache(**self.reset_kwargs)
        return True

    def run(self) -> None:
        from vllm.v1.core.sched.interface import PauseState
        from vllm.v1.request import RequestStatus

        spec, sched = self.spec, self.sched
        pending = sorted(spec["requests"], key=lambda r: r.get("add_at", 0))
        resets: dict[int, list[bool]] = {}
        for item in spec.get("reset_at", ()):
            s, running = (item, True) if isinstance(item, int) else item
            resets.setdefault(s, []).append(bool(running))
        pauses = {s: (m, c) for s, m, c in spec.get("pause_at", ())}
        aborts: dict[int, list[str]] = {}
        for s, rid in spec.get("abort_at", ()):
            aborts.setdefault(s, []).append(rid)
        sleeps = {s: (level, mode) for s, level, mode in spec.get("sleep_at", ())}
        wakes: dict[int, list[list[str] | None]] = {}
        for s, tags in spec.get("wake_at", ()):
            wakes.setdefault(s, []).append(tags)
        core = self.core = _engine_core(self) if sleeps or wakes else None
        last_wake = max(wakes, default=-1)
        # A paused scheduler has no requests to vLLM (has_requests): the engine waits on for
        # the wake-ups still to come, as EngineCore waits for its next call.
        while pending or self.queue or sched.has_requests() or self.step <= last_wake:
            step = self.step
            while pending and pending[0].get("add_at", 0) <= step:
                self.add(pending.pop(0))
            for running in resets.get(step, ()):
                sched.reset_prefix_cache(reset_running_requests=running)
            if step in aborts:
                self.aborted(sched.finish_requests(aborts[step], RequestStatus.FINISHED_ABORTED))
            if step in pauses:
                if not self.pause(*pauses[step]):
                    return
                sched.set_pause_state(PauseState.UNPAUSED)
            if core is not None:
                try:
                    if step in sleeps:
                        core.sleep(*sleeps[step])
                    for tags in wakes.get(step, ()):
                        core.wake_up(tags)
                except _Hung:
                    return
            if self.tick(self.engine_step() or bool(pending)):
                return


class DeviceFault(RuntimeError):
    """What the device does with a step that needs memory the executor released: on a GPU,
    the forward pass touches unmapped memory and the engine dies. The driver's model raises
    it instead of computing the step."""


class _Hung(Exception):
    """A sleep's pause did not complete: the run stops there (tick said why)."""


def _engine_core(driver: _Driver) -> Any:
    """vLLM's own EngineCore, as this release has it, for its sleep and wake_up to run on the
    driver's engine: made without its __init__ (no model, no processes), it holds the
    scheduler, the driver's pause (pause_scheduler, completed before it returns, as its
    future would be) and, as its executor, the release's own Executor.sleep / wake_up
    bookkeeping of what memory sleeps (sleeping_tags), whose collective_rpc to the workers
    is where the recorder hears of the memory going and coming back. So the order of the
    pause, the memory and the resume, and whether a partial wake-up resumes scheduling
    (#44395), are the release's."""
    import vllm.v1.engine.core as core_module
    from vllm.v1.executor.abstract import Executor

    core = core_module.EngineCore.__new__(core_module.EngineCore)
    core.scheduler = driver.sched
    core.model_executor = _executor_memory(Executor, driver.sched)
    checkpoint = getattr(core_module, "CheckpointState", None)
    if checkpoint is not None:  # vLLM 0.34 on: sleep and wake-up check it
        core._checkpoint_state = checkpoint.RUNNING
        core._kv_cache_reclaimable = False

    def pause_scheduler(mode: str = "abort", clear_cache: bool = True, **_: Any) -> None:
        if not driver.pause(mode, clear_cache):
            raise _Hung
        return None  # completed: EngineCore goes on at once, as with no step in flight

    core.pause_scheduler = pause_scheduler
    return core


def _executor_memory(executor_cls: type, sched: Any) -> Any:
    """An object with the release's Executor.sleep, wake_up and is_sleeping (a property
    since 0.34, an attribute before), and a collective_rpc that tells the recorder."""
    names = ("sleep", "wake_up", "is_sleeping")
    methods = {n: executor_cls.__dict__[n] for n in names if n in executor_cls.__dict__}

    class ExecutorMemory:
        def __init__(self) -> None:
            self.sleeping_tags: set[str] = set()
            if not isinstance(methods.get("is_sleeping"), property):
                self.is_sleeping = False

        def collective_rpc(
            self, method: str, timeout: Any = None, args: tuple = (), kwargs: Any = None
        ) -> list[Any]:
            kwargs = kwargs or {}
            if method == "sleep":
                sched.executor_slept(kwargs["level"])
            elif method == "wake_up":
                sched.executor_woke_up(kwargs.get("tags"))
            return [None]

    for name, member in methods.items():
        setattr(ExecutorMemory, name, member)
    return ExecutorMemory()


def serve(results: Any) -> None:
    """Specs from stdin, one JSON object a line; a result line each on `results`. The first
    line says {"ready": vLLM's version} once vLLM and the recorder are imported."""
    import vllm

    import tokentape.integrations.vllm.scheduler  # noqa: F401 - fails here, not mid-campaign

    results.write(json.dumps({"ready": vllm.__version__}) + "\n")
    results.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        try:
            result = run(spec)
        except SetupError as exc:
            result = {"setup_error": str(exc)}
        results.write(json.dumps(result) + "\n")
        results.flush()


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tokentape.integrations.vllm.scheduler_driver",
        description="Run vLLM's scheduler, recorded, on spec files (see the module).",
    )
    parser.add_argument("specs", nargs="*", metavar="SPEC.json")
    parser.add_argument("--serve", action="store_true", help="specs on stdin, one a line")
    parser.add_argument(
        "--tape", metavar="PATH", help="record onto PATH instead of the spec's tape (one spec)"
    )
    args = parser.parse_args(argv)
    # Only results on the real stdout: whatever else prints there (vLLM's logs) goes to stderr.
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    if args.serve:
        serve(results)
        return
    if args.tape and len(args.specs) != 1:
        parser.error("--tape names the tape of one spec")
    for path in args.specs:  # one spec after the other, vLLM imported once
        with open(path) as f:
            spec = json.load(f)
        if args.tape:
            spec["tape"] = args.tape
        result = run(spec)
        if spec.get("out"):
            with open(spec["out"], "w") as f:
                json.dump(result, f)
        else:  # a spec kept by a chaos run: the result goes to stdout
            results.write(json.dumps(result) + "\n")
            results.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
