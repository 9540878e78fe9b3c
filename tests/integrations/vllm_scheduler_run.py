"""vLLM's own scheduler, recorded, driven as vLLM's engine core drives it, with tokentape's
oracle as the model: the async path that vLLM's CPU engine cannot run end to end.

vLLM 0.32.0's CPU platform turns async scheduling off (vllm/platforms/cpu.py), so on a CPU
vLLM's AsyncScheduler runs only under a driver of its own. This one builds the scheduler as
EngineCore builds it, from `scheduler_cls` (tokentape's RecordingScheduler, which picks its
AsyncScheduler subclass for an async config), with a KV cache of `num_blocks` blocks and no
model, and repeats EngineCore's loop: `step_with_batch_queue` (a batch queue of depth 2: the
next step is scheduled before the previous one's output is applied) or `step`. The runner's
output for a sampling entry is the oracle's token at the position after the entry's tokens
(a pure function of prompt and position: any correct schedule delivers the oracle's stream).
Commands between steps as EngineCore issues them: aborts (`finish_requests`),
`reset_prefix_cache(reset_running_requests=True)` with steps in flight, and pauses as
`pause_scheduler` makes them (pause state, drain the queue, reset the caches when asked).

Runs in vLLM's Python with tokentape installed (`python vllm_scheduler_run.py SPEC.json...`,
each spec in turn).
Spec: {"model": folder (its config.json shapes the KV spec), "tape", "async": bool,
"num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
"requests": [{"id", "prompt", "max_tokens", "add_at"}], "reset_at": [step],
"pause_at": [[step, mode, clear_cache]], "abort_at": [[step, id]], "num_speculative_tokens": k
(n-gram drafts: the model accepts a seeded random number of them), "seed", "out"}. Writes
{"outputs": {id: {"tokens", "finish_reason"}}, "scheduler": class name, "steps": n, "hung":
[ids]}: where requests remain but HUNG_AFTER engine steps in a row run nothing (vLLM 0.20's
#42043 leaves a request whose placeholders block it for ever), the run stops there.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import sys
from collections import deque
from typing import Any

RECORDER = "tokentape.integrations.vllm.RecordingScheduler"
HUNG_AFTER = 100  # engine steps in a row that run nothing while requests remain: a hang


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from tokentape.engine.runners.oracle import OracleRunner
    from tokentape.events.schema import SamplingParams as TapeParams

    if spec.get("tape"):
        os.environ["TOKENTAPE_TAPE"] = spec["tape"]
    else:  # the recorder must refuse to start without a tape path
        os.environ.pop("TOKENTAPE_TAPE", None)
    block_size, num_blocks = spec["block_size"], spec["num_blocks"]
    k = spec.get("num_speculative_tokens", 0)
    speculative = SpeculativeConfig(model="ngram", num_speculative_tokens=k) if k else None
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
    from vllm.v1.engine.core import EngineCore

    reset_kwargs = {"reset_running_requests": True}
    if "reset_connector" in inspect.signature(EngineCore._reset_caches).parameters:
        reset_kwargs["reset_connector"] = True

    oracle = OracleRunner(cyclic=True, seed=0)
    keys: dict[str, int] = {}
    outputs: dict[str, dict[str, Any]] = {}
    queue: deque[tuple[Any, Any]] = deque()
    depth = 2 if spec["async"] else 1
    # The model, as the device sees each sequence: the position of its next sampled token and
    # the epoch it was computed in. Under async scheduling with drafts the scheduler counts
    # every draft as accepted until the output comes back, while the device continues from
    # what was accepted (vLLM's runner corrects the positions); a dropped token was still used.
    next_position: dict[str, tuple[int, int]] = {}
    accept = random.Random(spec.get("seed", 0))

    def run_model(out: Any) -> Any:
        """The runner's output for a step, computed as it is scheduled (the device runs it)."""
        before = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        ids = list(out.num_scheduled_tokens)
        tokens = []
        for r in ids:
            req = sched.requests[r]
            if req.is_prefill_chunk:
                tokens.append([])
                continue
            n, drafts = (
                out.num_scheduled_tokens[r],
                len(out.scheduled_spec_decode_tokens.get(r, ())),
            )
            position, epoch = next_position.get(r, (-1, -1))
            if epoch != req.num_preemptions or not drafts:  # a prefill, or a decode without drafts
                position = before[r] + n - drafts
            accepted = accept.randint(0, drafts)
            tokens.append([oracle.token_at(keys[r], position + i) for i in range(accepted + 1)])
            next_position[r] = (position + accepted + 1, req.num_preemptions)
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=tokens
        )

    def apply_oldest() -> bool:
        """Apply the oldest step's output; whether that step ran anything."""
        out, model_output = queue.popleft()
        for eco in sched.update_from_output(out, model_output).values():
            for o in eco.outputs:
                got = outputs.setdefault(o.request_id, {"tokens": [], "finish_reason": None})
                got["tokens"] += list(o.new_token_ids)
                if o.finish_reason is not None:
                    got["finish_reason"] = str(o.finish_reason)
        return out.total_num_scheduled_tokens > 0

    def schedule() -> bool:
        """Schedule one step; whether the model would have run it."""
        out = sched.schedule()
        queue.append((out, run_model(out)))
        return out.total_num_scheduled_tokens > 0

    def engine_step() -> bool:
        """EngineCore.step (depth 1) or step_with_batch_queue (depth 2); whether a step that
        ran anything was scheduled or came back."""
        executed = False
        if sched.has_requests():
            executed = schedule()
            if len(queue) < depth and (executed or sched.has_requests()):
                return executed
        elif not queue:
            return False
        return apply_oldest() or executed

    def aborted(requests: list[Any]) -> None:
        """What their clients get: vLLM's front end finishes a request it aborts itself, and
        the engine core sends the others an abort output."""
        for r in requests:  # Requests, or (id, client index) pairs before vLLM 0.26
            rid = r[0] if isinstance(r, tuple) else r.request_id
            outputs.setdefault(rid, {"tokens": [], "finish_reason": None})["finish_reason"] = (
                "abort"
            )

    def drain() -> None:
        while queue or sched.has_requests():
            engine_step()

    pending = sorted(spec["requests"], key=lambda r: r.get("add_at", 0))
    resets = set(spec.get("reset_at", ()))
    pauses = {s: (m, c) for s, m, c in spec.get("pause_at", ())}
    aborts: dict[int, list[str]] = {}
    for s, rid in spec.get("abort_at", ()):
        aborts.setdefault(s, []).append(rid)
    step = idle = 0
    hung: list[str] = []
    while pending or queue or sched.has_requests():
        while pending and pending[0].get("add_at", 0) <= step:
            r = pending.pop(0)
            params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0)
            keys[r["id"]] = oracle.request_key(r["prompt"], TapeParams())
            sched.add_request(
                Request(
                    request_id=r["id"],
                    prompt_token_ids=r["prompt"],
                    sampling_params=params,
                    pooling_params=None,
                    block_hasher=hasher,
                )
            )
        if step in resets:
            sched.reset_prefix_cache(reset_running_requests=True)
        if step in aborts:
            aborted(sched.finish_requests(aborts[step], RequestStatus.FINISHED_ABORTED))
        if step in pauses:
            mode, clear = pauses[step]
            if mode == "abort":
                aborted(sched.finish_requests(None, RequestStatus.FINISHED_ABORTED))
            sched.set_pause_state(
                PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
            )
            drain()  # the pause completes once the engine has no work
            if clear:  # EngineCore._reset_caches, as this release has it
                sched.reset_prefix_cache(**reset_kwargs)
            sched.set_pause_state(PauseState.UNPAUSED)
        idle = 0 if engine_step() or pending else idle + 1
        step += 1
        if idle >= HUNG_AFTER:  # EngineCore would spin here for ever
            hung = sorted(r for r, o in outputs.items() if o["finish_reason"] is None)
            break
    sched.shutdown()
    return {"outputs": outputs, "scheduler": type(sched).__name__, "steps": step, "hung": hung}


if __name__ == "__main__":
    for path in sys.argv[1:]:  # one spec after the other, vLLM imported once
        with open(path) as f:
            spec = json.load(f)
        result = run(spec)
        with open(spec["out"], "w") as f:
            json.dump(result, f)
