"""Stateful property test: random interleavings of client commands against LLMEngine.

A Hypothesis RuleBasedStateMachine draws one engine configuration per run (pipeline depth,
speculative tokens, discard policy, a small KV cache so that preemptions happen, sometimes a
small token budget for chunked prefill) and then interleaves add_request, abort_request,
step, pause_generation (every mode, with and without clear_cache), resume_generation,
reset_prefix_cache (with and without resetting running requests) and bad inputs.

Invariants, checked after every command:
  - under "epoch" every client-visible stream is a prefix of the oracle's stream, and the
    whole stream once the request finished other than by abort (no drop, no duplicate, no
    shift); the reducer's output_token_ids extend what the client got;
  - fold(tape) == live state (every FOLD_EVERY commands, and always at teardown);
  - discard counts are never negative; under "epoch" placeholders are never negative;
  - queues, statuses and KV reference counts agree with the requests' block lists.
At teardown: everything drains within a step bound, no KV block leaks, replay.verify(tape)
is ok, and under "epoch" every request ends with no placeholders and nothing in flight.

The plain tests at the bottom are minimised reproductions of engine bugs this machine found
(premature "length" finish with speculative decoding in an async pipeline; placeholders never
released by finished requests; a negative discard count under the "counter" policy).

Knobs: TOKENTAPE_SM_EXAMPLES (default 300), TOKENTAPE_SM_STEPS (default 40), and
TOKENTAPE_SM_STATS=1 to record coverage events (run with --hypothesis-show-statistics).
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import tokentape
from tokentape import SamplingParams
from tokentape.events.discard import discard_count
from tokentape.events.state import RequestStatus
from tokentape.replay import fold, verify

BLOCK_SIZE = 4
FIRST_TOKEN, VOCAB = 3, 259
# fold() is O(events); the runs are short, so fold after every command.
FOLD_EVERY = 1
MAX_EXAMPLES = int(os.environ.get("TOKENTAPE_SM_EXAMPLES", "300"))
STEP_COUNT = int(os.environ.get("TOKENTAPE_SM_STEPS", "40"))
STATS = bool(os.environ.get("TOKENTAPE_SM_STATS"))  # record coverage events

token_ids = st.integers(FIRST_TOKEN, VOCAB - 1)


@dataclass
class ClientRequest:
    """What the client sent and what it has been given so far."""

    prompt: list[int]
    params: SamplingParams
    expected: list[int]
    delivered: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None


def tape_dump(m: EngineMachine) -> str:
    """The engine config and every event on the tape: context for a failing assertion."""
    events = "\n".join(f"  {e!r}" for _, e in m.engine.engine_core.tape.iter_events())
    return f"\n{m.engine.config!r}\ntape:\n{events}"


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.llm: tokentape.LLM | None = None
        self.reqs: dict[str, ClientRequest] = {}
        self.next_id = 0
        self.commands = 0
        # True while a rule or invariant body runs; still True in teardown if one failed,
        # so that teardown does not bury the original failure under a second one.
        self.busy = False

    # -- configuration -----------------------------------------------------------------------

    @initialize(
        pipeline_depth=st.integers(1, 4),
        num_spec=st.integers(0, 3),
        policy=st.sampled_from(["epoch", "epoch", "epoch", "counter", "flag"]),
        num_kv_blocks=st.integers(8, 24),
        budget=st.sampled_from([8192, 16, 7]),
        max_num_seqs=st.sampled_from([256, 4, 2]),
        prefix_caching=st.booleans(),
        initial_requests=st.integers(1, 5),
        data=st.data(),
    )
    def configure(
        self,
        pipeline_depth,
        num_spec,
        policy,
        num_kv_blocks,
        budget,
        max_num_seqs,
        prefix_caching,
        initial_requests,
        data,
    ):
        self.busy = True
        self.llm = tokentape.LLM(
            model="oracle",
            tape=None,
            pipeline_depth=pipeline_depth,
            num_speculative_tokens=num_spec,
            discard_policy=policy,
            block_size=BLOCK_SIZE,
            num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=max(budget, 1 + num_spec),
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=prefix_caching,
        )
        self.epoch = policy == "epoch"
        for _ in range(initial_requests):
            self.add_one_request(data)
        self.busy = False

    @property
    def engine(self):
        return self.llm.llm_engine

    @property
    def max_len(self) -> int:
        return self.llm.config.effective_max_model_len

    def expected_stream(self, prompt: list[int], params: SamplingParams) -> list[int]:
        return self.engine.engine_core.runner.expected_stream(
            prompt, params, max_model_len=self.max_len
        )

    def take_outputs(self, outputs) -> None:
        for out in outputs:
            req = self.reqs.get(out.request_id)
            assert req is not None, f"output for a request the client never added: {out!r}"
            assert not req.finished, (
                f"request {out.request_id}: output {out.outputs[0].token_ids} after it finished "
                f"({req.finish_reason}) with {req.delivered}"
            )
            got = out.outputs[0].token_ids  # cumulative: what it had, then the new tokens
            assert got[: len(req.delivered)] == req.delivered, (out.request_id, req.delivered, got)
            req.delivered = list(got)
            if out.finished:
                req.finished = True
                req.finish_reason = out.outputs[0].finish_reason
                assert req.finish_reason in ("stop", "length", "abort"), out

    # -- commands ----------------------------------------------------------------------------

    @rule(data=st.data(), count=st.integers(1, 3))
    def add_requests(self, data, count):
        self.busy = True
        for _ in range(count):
            self.add_one_request(data)
        self.commands += 1
        self.busy = False

    def add_one_request(self, data):
        shared = data.draw(
            st.sampled_from([[], [7, 8, 9, 10, 11, 12, 13, 14], [7, 8, 9, 10]]),
            label="shared_prefix",
        )
        longest = min(16, self.max_len - 1)
        suffix = data.draw(st.lists(token_ids, min_size=1, max_size=longest), label="suffix")
        prompt = (shared + suffix)[:longest]
        max_tokens = data.draw(st.integers(1, 24), label="max_tokens")
        seed = data.draw(st.one_of(st.none(), st.integers(0, 3)), label="seed")
        stop: tuple[int, ...] = ()
        if data.draw(st.booleans(), label="with_stop"):
            # Pick a stop token that the oracle actually produces, so stops happen early.
            plain = self.expected_stream(prompt, SamplingParams(max_tokens=max_tokens, seed=seed))
            stop = (data.draw(st.sampled_from(plain), label="stop_token"),)
        params = SamplingParams(max_tokens=max_tokens, seed=seed, stop_token_ids=stop)
        req_id = f"r{self.next_id}"
        self.next_id += 1
        self.engine.add_request(req_id, prompt, params)
        self.reqs[req_id] = ClientRequest(prompt, params, self.expected_stream(prompt, params))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort_request(self, data):
        self.busy = True
        unfinished = sorted(r for r, c in self.reqs.items() if not c.finished)
        use_unfinished = unfinished and data.draw(st.booleans(), label="unfinished")
        pool = unfinished if use_unfinished else sorted(self.reqs)
        req_id = data.draw(st.sampled_from(pool), label="req_id")
        self.engine.abort_request(req_id)
        assert self.engine.engine_core.state.requests[req_id].is_finished
        self.commands += 1
        self.busy = False

    @rule(n=st.integers(1, 8))
    def step(self, n):
        self.busy = True
        for _ in range(n):
            self.take_outputs(self.engine.step())
        self.commands += 1
        self.busy = False

    @rule(mode=st.sampled_from(["abort", "wait", "keep"]), clear_cache=st.booleans())
    def pause_generation(self, mode, clear_cache):
        self.busy = True
        self.engine.pause_generation(mode, clear_cache)
        assert self.engine.is_paused()
        assert not self.engine.engine_core.state.in_flight_steps, (
            "pause_generation returned before the engine drained"
        )
        if mode == "abort":
            assert not self.engine.engine_core.state.unfinished
        if mode == "wait":
            assert not self.engine.engine_core.state.running
        if clear_cache:
            assert self.engine.engine_core.kv.num_used_blocks == 0
        self.commands += 1
        self.busy = False

    @rule()
    def resume_generation(self):
        self.busy = True
        self.engine.resume_generation()
        assert not self.engine.is_paused()
        self.commands += 1
        self.busy = False

    @rule(reset_running=st.booleans())
    def reset_prefix_cache(self, reset_running):
        self.busy = True
        used = self.engine.engine_core.kv.num_used_blocks
        ok = self.engine.reset_prefix_cache(reset_running_requests=reset_running)
        assert ok == (reset_running or used == 0), (ok, reset_running, used)
        if reset_running:
            assert not self.engine.engine_core.state.running
            assert self.engine.engine_core.kv.num_used_blocks == 0
        self.commands += 1
        self.busy = False

    @rule(
        kind=st.sampled_from(
            [
                "unknown_abort",
                "duplicate",
                "max_tokens",
                "too_long",
                "empty",
                "bad_token",
                "bad_mode",
            ]
        )
    )
    def bad_input(self, kind):
        self.busy = True
        engine = self.engine
        events_before = len(engine.engine_core.tape)
        if kind == "unknown_abort":
            with pytest.raises(KeyError):
                engine.abort_request("no-such-request")
        elif kind == "duplicate":
            if not self.reqs:
                self.busy = False
                return
            with pytest.raises(ValueError):
                engine.add_request(sorted(self.reqs)[0], [5, 6], SamplingParams(max_tokens=2))
        elif kind == "max_tokens":
            with pytest.raises(ValueError):
                SamplingParams(max_tokens=0)
        elif kind == "too_long":
            with pytest.raises(ValueError, match="num_kv_blocks"):
                engine.add_request("too-long", [5] * self.max_len, SamplingParams(max_tokens=2))
        elif kind == "empty":
            with pytest.raises(ValueError):
                engine.add_request("empty", [], SamplingParams(max_tokens=2))
        elif kind == "bad_token":
            with pytest.raises(ValueError):
                engine.add_request("bad-token", [5, VOCAB], SamplingParams(max_tokens=2))
        else:
            with pytest.raises(ValueError):
                engine.pause_generation("sleep")
        # A rejected command leaves no trace and the engine keeps serving.
        assert len(engine.engine_core.tape) == events_before
        assert engine.engine_core._dead is None
        self.commands += 1
        self.busy = False

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def streams_are_exact(self):
        if self.llm is None:
            return
        self.busy = True
        state = self.engine.engine_core.state
        for req_id, c in self.reqs.items():
            r = state.requests[req_id]
            out = r.output_token_ids
            # Every policy: the client got a prefix of what the reducer holds, never more
            # than max_tokens, and a finish only for a finished request.
            assert out[: len(c.delivered)] == c.delivered, (req_id, c.delivered, out)
            assert len(out) <= c.params.max_tokens, (req_id, out, c.params)
            if c.finished:
                assert r.is_finished and r.finish_reason == c.finish_reason, (req_id, r.status)
                assert c.delivered == out, (req_id, c.delivered, out)
            if not self.epoch:
                continue
            assert c.expected[: len(out)] == out, (
                f"{req_id}: reducer holds {out}, oracle stream is {c.expected}" + tape_dump(self)
            )
            assert c.expected[: len(c.delivered)] == c.delivered, (
                f"{req_id}: client got {c.delivered}, oracle stream is {c.expected}"
            )
            if c.finished and c.finish_reason != "abort":
                assert c.delivered == c.expected, (
                    f"{req_id} finished ({c.finish_reason}) with {c.delivered}, "
                    f"oracle stream is {c.expected}" + tape_dump(self)
                )
                want = "stop" if c.expected[-1] in c.params.stop_token_ids else "length"
                assert c.finish_reason == want, (req_id, c.finish_reason, want)
        self.busy = False

    @invariant()
    def counts_never_negative(self):
        if self.llm is None:
            return
        self.busy = True
        state = self.engine.engine_core.state
        for r in state.requests.values():
            assert discard_count(state, r) >= 0, (r.req_id, discard_count(state, r), r)
            in_flight = [
                (s, e) for s in state.in_flight_steps for e in s.entries if e.req_id == r.req_id
            ]
            assert r.num_in_flight == len(in_flight), (r.req_id, r.num_in_flight, r)
            stale = sum(1 for _, e in in_flight if e.epoch != r.epoch)
            assert r.num_stale_in_flight == stale, (r.req_id, r.num_stale_in_flight, r)
            fresh_entries = [e for s, e in in_flight if e.epoch == r.epoch and s.samples(e)]
            assert r.num_fresh_in_flight == len(fresh_entries), (r.req_id, r.num_fresh_in_flight, r)
            if self.epoch:
                assert r.num_output_placeholders >= 0, (r.req_id, r.num_output_placeholders, r)
                fresh = sum(1 + e.num_spec_tokens for e in fresh_entries)
                if not r.is_finished:
                    assert r.num_output_placeholders == fresh, (
                        r.req_id,
                        r.num_output_placeholders,
                        fresh,
                        r,
                    )
        self.busy = False

    @invariant()
    def queues_and_blocks_agree(self):
        if self.llm is None:
            return
        self.busy = True
        state, kv = self.engine.engine_core.state, self.engine.engine_core.kv
        waiting, running = list(state.waiting), list(state.running)
        assert len(set(waiting)) == len(waiting) and len(set(running)) == len(running)
        assert not set(waiting) & set(running)
        unfinished = {r.req_id for r in state.unfinished}
        assert set(waiting) | set(running) == unfinished, (waiting, running, unfinished)
        refs = collections.Counter()
        for r in state.requests.values():
            if r.req_id in running:
                assert r.status is RequestStatus.RUNNING
            elif r.req_id in waiting:
                assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                assert not r.block_ids, (r.req_id, r.block_ids)
            else:
                assert r.is_finished and not r.block_ids, (r.req_id, r.status, r.block_ids)
            assert len(set(r.block_ids)) == len(r.block_ids), (r.req_id, r.block_ids)
            refs.update(r.block_ids)
        held = [refs.get(b, 0) for b in range(kv.num_blocks)]
        assert held == kv.ref_cnt, ("requests hold", held, "KV ref counts", kv.ref_cnt)
        assert kv.num_free_blocks == sum(1 for c in kv.ref_cnt if c == 0)
        self.busy = False

    @invariant()
    def fold_equals_live(self):
        if self.llm is None or self.commands % FOLD_EVERY:
            return
        self.busy = True
        folded = fold(self.engine.engine_core.tape)
        assert folded == self.engine.engine_core.state, (
            "fold(tape) differs from the live engine state"
        )
        self.busy = False

    def record_coverage(self) -> None:
        """Hypothesis events (see --hypothesis-show-statistics): did the run reach the paths
        this machine is for?"""
        state = self.engine.engine_core.state
        event(f"requests: {min(len(state.requests) // 3 * 3, 12)}+")
        kinds = collections.Counter(
            type(e).__name__ + (f":{e.reason}" if hasattr(e, "reason") else "")
            for _, e in self.engine.engine_core.tape.iter_events()
        )
        for kind in (
            "RequestPreempted:kv_pressure",
            "RequestPreempted:reset_prefix_cache",
            "RequestFinished:stop",
            "RequestAborted",
            "GenerationPaused",
        ):
            event(f"{kind}: {kinds[kind] > 0}")
        event(f"frames dropped: {any(r.num_frames_dropped for r in state.requests.values())}")

    # -- teardown ----------------------------------------------------------------------------

    def teardown(self):
        if self.llm is None or self.busy:
            return  # a rule or invariant already failed: report that failure, not this one
        engine = self.engine
        engine.resume_generation()
        limit = 50 + sum(len(c.prompt) + c.params.max_tokens for c in self.reqs.values()) * 4
        steps = 0
        while engine.has_unfinished_requests():
            assert steps < limit, f"the engine did not drain within {limit} steps"
            self.take_outputs(engine.step())
            steps += 1
        if STATS:
            self.record_coverage()
        self.streams_are_exact()
        self.counts_never_negative()
        self.queues_and_blocks_agree()
        state = engine.engine_core.state
        assert fold(engine.engine_core.tape) == state, (
            "fold(tape) differs from the live engine state"
        )
        # (d) nothing leaks once everything finished
        assert engine.engine_core.kv.num_free_blocks == engine.engine_core.kv.num_blocks, (
            engine.engine_core.kv.ref_cnt
        )
        for req_id, c in self.reqs.items():
            r = state.requests[req_id]
            assert r.is_finished and not r.block_ids, (req_id, r.status, r.block_ids)
            assert c.finished, f"{req_id} finished in the engine but the client was never told"
        if self.epoch:
            for req_id, r in state.requests.items():
                assert not r.num_in_flight, (req_id, r.num_in_flight)
                assert r.num_output_placeholders == 0, (req_id, r.num_output_placeholders, r)
        # (c) the tape replays
        result = verify(engine.engine_core.tape)
        assert result.ok, result.first_divergence.format() if result.first_divergence else result
        self.llm.close()


TestEngineStateMachine = EngineMachine.TestCase
TestEngineStateMachine.settings = settings(
    max_examples=MAX_EXAMPLES,
    stateful_step_count=STEP_COUNT,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)


# -- minimised reproductions of what the machine found ------------------------------------------
# Plain tests, deterministic; each fails while its bug is present.


def _drain(engine, limit: int = 500) -> dict[str, list[int]]:
    delivered: dict[str, list[int]] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return delivered
        for out in engine.step():
            delivered[out.request_id] = out.outputs[0].token_ids  # cumulative: every token so far
    raise AssertionError(f"the engine did not drain within {limit} steps")


def test_repro_spec_decode_pipeline_not_cut_short_by_max_model_len():
    """Epoch policy, async pipeline with speculative decoding, one request that fits the KV
    cache: the scheduler's max_model_len cap compares num_computed_tokens (which counts the
    draft positions of steps still in flight) with max_model_len, and finishes the request
    with "length" before the in-flight frames come back. The client gets 16 of 19 tokens."""
    llm = tokentape.LLM(
        model="oracle",
        tape=None,
        pipeline_depth=3,
        num_speculative_tokens=1,
        block_size=4,
        num_kv_blocks=8,
    )  # max_model_len = 32
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 3, 3, 3, 3, 4]  # 13 tokens
    params = SamplingParams(max_tokens=19)  # 13 + 19 = 32 tokens: fits exactly
    want = llm.llm_engine.engine_core.runner.expected_stream(
        prompt, params, max_model_len=llm.config.effective_max_model_len
    )
    assert len(want) == 19
    out = llm.generate(prompt, params)[0].outputs[0]
    assert out.token_ids == want, (out.finish_reason, len(out.token_ids), len(want))
    assert out.finish_reason == "length"


def test_repro_spec_decode_pipeline_not_cut_short_below_max_model_len():
    """The same cap fires even when the whole stream stays below max_model_len (9 + 21 = 30
    of 32 tokens): the optimistic draft positions alone push num_computed_tokens past it."""
    llm = tokentape.LLM(
        model="oracle",
        tape=None,
        pipeline_depth=3,
        num_speculative_tokens=2,
        block_size=4,
        num_kv_blocks=8,
        enable_prefix_caching=False,
    )
    prompt = [3, 126, 3, 3, 3, 5, 14, 3, 17]
    params = SamplingParams(max_tokens=21)
    want = llm.llm_engine.engine_core.runner.expected_stream(
        prompt, params, max_model_len=llm.config.effective_max_model_len
    )
    assert len(want) == 21
    out = llm.generate(prompt, params)[0].outputs[0]
    assert out.token_ids == want, (out.finish_reason, len(out.token_ids), len(want))


def test_repro_finished_requests_keep_output_placeholders():
    """Epoch policy, pipeline_depth=2: a request that finishes (stop, or abort) while a step
    of it is in flight never gives that step's placeholders back: the reducer skips the
    decrement for the frames of a finished request. Once idle, nothing is in flight, yet
    num_output_placeholders stays 1."""
    llm = tokentape.LLM(model="oracle", tape=None, pipeline_depth=2, block_size=4, num_kv_blocks=8)
    engine = llm.llm_engine
    first = engine.engine_core.runner.expected_stream([3], SamplingParams(max_tokens=1))[0]
    engine.add_request("stop", [3], SamplingParams(max_tokens=4, stop_token_ids=(first,)))
    _drain(engine)
    engine.add_request("abort", [3, 4], SamplingParams(max_tokens=4))
    engine.step()
    engine.abort_request("abort")
    _drain(engine)
    for req_id, reason in (("stop", "stop"), ("abort", "abort")):
        req = engine.engine_core.state.requests[req_id]
        assert req.finish_reason == reason
        assert not req.num_in_flight
        assert req.num_output_placeholders == 0, (req_id, req.num_output_placeholders)


def test_repro_counter_policy_discard_count_goes_negative():
    """Counter policy (vLLM after #42117): two preemptions in a row overwrite the counter, so
    stale frames slip through and drive num_output_placeholders below zero (the historical
    bug, expected); the next preemption then copies the negative placeholder count into
    async_tokens_to_discard, and the derived discard count becomes -1."""
    llm = tokentape.LLM(
        model="oracle",
        tape=None,
        pipeline_depth=4,
        discard_policy="counter",
        block_size=4,
        num_kv_blocks=8,
    )
    engine = llm.llm_engine
    engine.add_request("r0", [3], SamplingParams(max_tokens=16))
    req = engine.engine_core.state.requests["r0"]
    counts = []
    for _ in range(3):
        engine.step()
    engine.reset_prefix_cache(reset_running_requests=True)  # 3 in flight: counter = 3
    engine.step()  # recompute scheduled; one stale frame dropped
    engine.reset_prefix_cache(reset_running_requests=True)  # overwrites the counter with 1
    counts.append(discard_count(engine.engine_core.state, req))
    engine.pause_generation("keep", clear_cache=False)  # drains: two stale frames slip through
    engine.resume_generation()
    engine.step()
    engine.reset_prefix_cache(reset_running_requests=True)  # counter = placeholders (< 0)
    counts.append(discard_count(engine.engine_core.state, req))
    _drain(engine)
    assert min(counts) >= 0, (counts, req)
