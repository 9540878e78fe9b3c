"""What a tape and its derived state say, as ordered dicts and lines: the header, the engine,
one request in full, and what one event changed. `tokentape inspect` and the debugger print
them (through tokentape.replay.render's views); `inspect --json` prints the request detail.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from tokentape.events.discard import discard_count
from tokentape.events.state import EngineState, RequestState
from tokentape.replay.tape import Tape


def _yes_no(value: bool) -> str:
    return "yes" if value else "no"


def header_summary(tape: Tape, num_events: int) -> dict[str, Any]:
    h, c = tape.header, tape.config
    depth = c.effective_pipeline_depth
    return {
        "tape": tape.path or "<memory>",
        "format version": h.format_version,
        "package version": h.package_version,
        **(
            {"recorded from": f"{h.source} {h.source_version}".strip()}
            if h.source != "tokentape"
            else {}
        ),
        **({"recorder's note": h.source_note} if h.source_note else {}),
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


def engine_summary(state: EngineState) -> dict[str, Any]:
    in_flight = [s.step for s in state.in_flight_steps]
    return {
        "steps scheduled": state.step,
        "paused": state.paused or "no",
        "waiting": len(state.waiting),
        "running": len(state.running),
        "in-flight steps": f"{len(in_flight)} {in_flight}" if in_flight else "0",
        "prefix cache resets": state.num_prefix_cache_resets,
        "weights id": state.weights_id or "-",
        "LoRA adapters": ", ".join(f"{a.lora_name} ({i})" for i, a in state.loras.items()) or "-",
        "requests": len(state.requests),
        "finished": sum(1 for r in state.requests.values() if r.is_finished),
        "events folded": state.num_events,
        "engine error": state.error or "-",
    }


def request_detail(state: EngineState, req: RequestState) -> dict[str, Any]:
    """Every derived field of one request (JSON-ready)."""
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
        "discard_count": discard_count(state, req),
        "async_tokens_to_discard": req.async_tokens_to_discard,
        "discard_latest_async_tokens": req.discard_latest_async_tokens,
        "drop_stale_output": req.drop_stale_output,
        "num_frames_dropped": req.num_frames_dropped,
        "num_preemptions": req.num_preemptions,
        "block_ids": list(req.block_ids),
        "in_flight": [
            {
                "step": step,
                "epoch": e.epoch,
                "num_spec_tokens": e.num_spec_tokens,
                "stale": e.epoch != req.epoch,
            }
            for step, e in state.in_flight_entries(req.req_id)
        ],
        "finish_reason": req.finish_reason,
        "stop_reason": req.stop_reason,
        "lora_int_id": req.lora_int_id,
        "output_pending": req.req_id in state.pending_output,
    }


_ENGINE_FIELDS: dict[str, Callable[[EngineState], Any]] = {
    "step": lambda s: s.step,
    "paused": lambda s: s.paused,
    "waiting": lambda s: list(s.waiting),
    "running": lambda s: list(s.running),
    "in_flight_steps": lambda s: [x.step for x in s.in_flight_steps],
    "pending_output": lambda s: list(s.pending_output),
    "num_prefix_cache_resets": lambda s: s.num_prefix_cache_resets,
    "weights_id": lambda s: s.weights_id,
    "error": lambda s: s.error,
}


def state_changes(before: EngineState, after: EngineState) -> list[str]:
    """Lines naming every derived field that differs: engine-level, then per request."""
    lines: list[str] = []
    for name, get in _ENGINE_FIELDS.items():
        old, new = get(before), get(after)
        if old != new:
            lines.append(f"{name}: {old} -> {new}")
    for req_id, req in after.requests.items():
        new_detail = request_detail(after, req)
        old_req = before.requests.get(req_id)
        if old_req is None:
            lines.append(
                f"+ request {req_id} added ({new_detail['num_prompt_tokens']} prompt tokens)"
            )
            continue
        old_detail = request_detail(before, old_req)
        for key, new in new_detail.items():
            old = old_detail[key]
            if old == new:
                continue
            if key == "output_token_ids" and isinstance(old, list) and new[: len(old)] == old:
                lines.append(f"{req_id}.output_token_ids: + {new[len(old) :]}")
            else:
                lines.append(f"{req_id}.{key}: {old} -> {new}")
    return lines
