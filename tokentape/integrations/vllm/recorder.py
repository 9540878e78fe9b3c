"""TapeRecorder: vLLM's scheduler calls, as tokentape events, in the order tokentape's own
engine appends them. The recording scheduler (scheduler.py) calls it around each of vLLM's
methods; it reads vLLM's objects by attribute and never changes them.

- `add_request` -> RequestAdded;
- `schedule()` -> RequestPreempted for each KV-pressure preemption while it plans, then
  StepScheduled (an empty schedule records nothing and takes no step number);
- `update_from_output()` -> FrameProduced (the sampled ids per sampling entry, before vLLM
  trims them at a stop), RequestFinished for each stop it found, OutputsEmitted (what it
  returned for the clients);
- `finish_requests()` (aborts; the front end's stop strings) -> RequestAborted or
  RequestFinished, and OutputsEmitted with the finish the client is given;
- `reset_prefix_cache()` -> PrefixCacheReset with its result, then the preemptions it made;
- `set_pause_state()` -> GenerationPaused (PAUSED_ALL: keep, PAUSED_NEW: wait) or
  GenerationResumed. vLLM's pause with clear_cache resets the cache once drained: that reset
  is recorded where it happens, so every GenerationPaused has clear_cache False.

Requests go on the tape under the id their client gave (vLLM's engine core sees it with a
random suffix; see mapping.client_request_id), so that a vLLM tape and a tokentape tape of the
same workload diff request by request; a client id used twice keeps vLLM's own id, and an id
vLLM itself sees again (after its first request finished) gets `~2`, `~3`, ... on the tape.

Each call ends with a commit, so a killed engine leaves a tape complete to its last call.

With a `checker` (tokentape.replay.verify_recorded.ConsistencyChecker), every event is checked
against the fold of those before it as it is recorded: where vLLM's state was changed outside
the calls the recorder follows (a test setting a request's position by hand), `_append` raises
RecordingLost instead of writing an event the tape cannot explain, and `stop` ends the tape with
a RecordingStopped that says why.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tokentape.events import schema as ev
from tokentape.events.store import TapeWriter
from tokentape.integrations.vllm.mapping import client_request_id
from tokentape.replay.verify_recorded import ConsistencyChecker, Inconsistent


class RecorderError(RuntimeError):
    """vLLM called the scheduler in an order the recorder cannot follow."""


class RecordingLost(RecorderError):
    """The next event would contradict the tape: vLLM's state changed behind the recorder."""


@dataclass(slots=True)
class _Flight:
    """A schedule() whose update_from_output has not come yet."""

    output: Any  # vLLM's SchedulerOutput (compared by identity)
    step: int | None  # None: an empty schedule, not on the tape
    sampling: list[tuple[str, list[int]]]  # (request, draft ids) of each sampling entry, in order


class TapeRecorder:
    def __init__(
        self,
        tape: TapeWriter,
        vocab_size: int,
        randomized_ids: bool = True,
        checker: ConsistencyChecker | None = None,
    ) -> None:
        self.tape = tape
        self.checker = checker
        self.vocab_size = vocab_size
        self.randomized_ids = randomized_ids
        self.ids: dict[str, str] = {}  # vLLM's request id -> the id on the tape
        self.step = 0  # the number of the next step to be scheduled
        self.in_flight: deque[_Flight] = deque()
        self.tape_ids: set[str] = set()
        self.finished: set[str] = set()  # requests finished on the tape (tape ids)
        self.with_logprobs: set[str] = set()
        self.paused: ev.PauseMode | None = None
        self._reset_preemptions: list[ev.Event] | None = None  # held while a reset runs

    def _tape_id(self, internal: str) -> str:
        try:
            return self.ids[internal]
        except KeyError:
            raise RecordingLost(
                f"vLLM's scheduler has request {internal!r}, which was never added "
                "through add_request"
            ) from None

    def _append(self, event: ev.Event) -> None:
        if self.checker is not None:
            try:
                self.checker.check(event)
            except Inconsistent as exc:
                raise RecordingLost(
                    f"vLLM's scheduler state changed outside the calls the recorder "
                    f"follows: {exc.message}"
                ) from None
        self.tape.append(event)

    # -- commands --------------------------------------------------------------------------------

    def added(self, request: Any, params: ev.SamplingParams) -> None:
        internal = request.request_id
        rid = client_request_id(internal, self.randomized_ids)
        if rid != internal and rid in self.tape_ids:
            rid = internal  # the client reused its id: keep vLLM's, which is unique
        if rid in self.tape_ids:  # vLLM's own id again, after its request finished
            rid = next(
                f"{rid}~{n}" for n in itertools.count(2) if f"{rid}~{n}" not in self.tape_ids
            )
        self.ids[internal] = rid
        self.tape_ids.add(rid)
        self._append(ev.RequestAdded(self.step, rid, list(request.prompt_token_ids), params))
        if params.logprobs is not None:
            self.with_logprobs.add(rid)
        self.tape.commit()

    def finished_by_call(
        self, finished: Iterable[Any], reason: ev.FinishReason, deliver: bool
    ) -> None:
        """What vLLM's finish_requests returned: the Requests it finished (0.26 on), or their
        (request id, client index) pairs (before). `deliver`: record what their clients are
        given now (False inside update_from_output, whose outputs say it)."""
        entries = []
        for item in finished:
            rid = self.ids.get(item[0] if isinstance(item, tuple) else item.request_id)
            if rid is None or rid in self.finished:
                continue
            self.finished.add(rid)
            self._append(
                ev.RequestAborted(self.step, rid)
                if reason == "abort"
                else ev.RequestFinished(self.step, rid, reason)
            )
            entries.append(ev.EmittedOutput(rid, [], True, reason))
        if deliver and entries:
            self._append(ev.OutputsEmitted(self.step, entries))
        if entries:
            self.tape.commit()

    def pause_state(self, name: str) -> None:
        """vLLM's PauseState, by name, after set_pause_state."""
        mode: ev.PauseMode | None = {"PAUSED_ALL": "keep", "PAUSED_NEW": "wait"}.get(name)
        if mode == self.paused:
            return
        if mode is None:
            self._append(ev.GenerationResumed(self.step))
        else:
            self._append(ev.GenerationPaused(self.step, mode, False))
        self.paused = mode
        self.tape.commit()

    def slept(self, level: int) -> None:
        """The executor released its memory at `level` (vLLM's EngineCore.sleep, after its
        pause): the steps still in flight, and the unfinished requests kept for the wake-up."""
        in_flight = [f.step for f in self.in_flight if f.step is not None]
        kept = [rid for rid in self.ids.values() if rid not in self.finished]
        self._append(ev.EngineSlept(self.step, level, in_flight, kept))
        self.tape.commit()

    def woke_up(self, tags: list[str] | None) -> None:
        """The executor woke `tags` (None: everything) up, before any resume that follows."""
        self._append(ev.EngineWokeUp(self.step, None if tags is None else list(tags)))
        self.tape.commit()

    def begin_reset(self) -> None:
        self._reset_preemptions = []

    def end_reset(self, reset_running_requests: bool, ok: bool) -> None:
        held, self._reset_preemptions = self._reset_preemptions or [], None
        self._append(ev.PrefixCacheReset(self.step, reset_running_requests, ok))
        for event in held:
            self._append(event)
        self.tape.commit()

    # -- the scheduler's own decisions ---------------------------------------------------------

    def preempted(self, request: Any) -> None:
        """Called as vLLM preempts a request (inside schedule() or reset_prefix_cache())."""
        internal = request.request_id
        rid = self._tape_id(internal)
        in_flight = sum(
            1
            for f in self.in_flight
            if f.step is not None and internal in f.output.num_scheduled_tokens
        )
        if self._reset_preemptions is not None:
            self._reset_preemptions.append(
                ev.RequestPreempted(self.step, rid, "reset_prefix_cache", in_flight)
            )
        else:
            self._append(ev.RequestPreempted(self.step, rid, "kv_pressure", in_flight))

    def scheduled(self, output: Any, requests: Mapping[str, Any]) -> None:
        """After schedule() returned `output` (vLLM has advanced num_computed_tokens)."""
        counts: dict[str, int] = output.num_scheduled_tokens
        if not counts:
            self.in_flight.append(_Flight(output, None, []))
            return
        blocks: dict[str, Any] = {d.req_id: d.block_ids for d in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        blocks.update(zip(cached.req_ids, cached.new_block_ids))
        spec: dict[str, list[int]] = output.scheduled_spec_decode_tokens
        entries, sampling = [], []
        for internal, n in counts.items():
            req = requests[internal]
            groups = blocks.get(internal)
            drafts = spec.get(internal, ())
            entries.append(
                ev.ScheduledEntry(
                    self._tape_id(internal),
                    req.num_preemptions,
                    req.num_computed_tokens - n,
                    n,
                    len(drafts),
                    list(groups[0]) if groups else [],
                )
            )
            if not req.is_prefill_chunk:
                # Under async scheduling the drafts are -1 placeholders, filled in on the device.
                sampling.append((internal, [] if any(d < 0 for d in drafts) else list(drafts)))
        self._append(ev.StepScheduled(self.step, entries))
        self.in_flight.append(_Flight(output, self.step, sampling))
        self.step += 1

    def frame(self, output: Any, runner_output: Any) -> bool:
        """Before update_from_output applies `runner_output`; False for an empty step."""
        if not self.in_flight or self.in_flight[0].output is not output:
            raise RecorderError(
                "update_from_output() was given a SchedulerOutput other than the oldest "
                "one schedule() returned (built by hand, or out of order)"
            )
        flight = self.in_flight.popleft()
        if flight.step is None:
            return False
        # vLLM 0.34 dropped the output's req_id_to_index: the index is the order of req_ids.
        index: dict[str, int] = getattr(runner_output, "req_id_to_index", None) or {
            r: i for i, r in enumerate(runner_output.req_ids)
        }
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        entries = []
        for internal, drafts in flight.sampling:
            rid = self._tape_id(internal)
            i = index.get(internal)
            tokens = [int(t) for t in sampled[i]] if i is not None and sampled else []
            lps = None
            if rid in self.with_logprobs and logprobs is not None and i is not None and tokens:
                lps = [float(x) for x in logprobs.slice_request(i, len(tokens)).logprobs[:, 0]]
            entries.append(ev.FrameEntry(rid, tokens, drafts, lps))
        self._append(ev.FrameProduced(flight.step, entries))
        return True

    def delivered(self, outputs: Mapping[int, Any], reason_of: Any, framed: bool) -> None:
        """After update_from_output returned `outputs` (client index -> EngineCoreOutputs)."""
        entries = []
        for eco in outputs.values():
            for out in eco.outputs:
                rid = self.ids.get(out.request_id, out.request_id)
                reason = reason_of(out.finish_reason)
                if reason in ("stop", "length") and rid not in self.finished:
                    self.finished.add(rid)
                    self._append(ev.RequestFinished(self.step, rid, reason))
                entries.append(
                    ev.EmittedOutput(
                        rid, [int(t) for t in out.new_token_ids], reason is not None, reason
                    )
                )
        if framed or entries:
            self._append(ev.OutputsEmitted(self.step, entries))
        self.tape.commit()

    def error(self, exc: BaseException) -> None:
        """vLLM's scheduler or executor raised: the run ends here, as tokentape's engine
        records it."""
        self.tape.append(ev.EngineError(self.step, type(exc).__name__, str(exc)))
        self.tape.flush()

    def stop(self, reason: str) -> None:
        """The recorder lost track of the run: the tape ends here and says why."""
        self.tape.append(ev.RecordingStopped(self.step, reason))
        self.tape.flush()

    def close(self) -> None:
        self.tape.close()
