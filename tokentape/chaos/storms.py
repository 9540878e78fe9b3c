"""Seeded storms: a real engine driven through adds, pauses in every mode, resumes, prefix-cache
resets with and without running requests, aborts (one, or all at once), KV pressure, weight
updates (versioned, whole or chunked), sleeps at every level and wake-ups of every tag,
recording what its client received.

    result = run_storm(StormSpec(seed=7, pipeline_depth=3, num_speculative_tokens=2))
    result.oracle_violations()          # {} under the epoch policy, always
    postmortem(result.tape)             # what the tape says went wrong, if anything

The model is the oracle, whose stream is a pure function of (prompt, position, seed): under
`epoch` every request must receive exactly `result.expected[req_id]` (a prefix of it when
aborted), whatever the storm did; under `counter` and `flag` the stream may break, and the
postmortem must then name why. A storm is a list of command names (`COMMANDS`), drawn from
the seed by `storm_commands` or given explicitly (Hypothesis draws them in the tests); the
choices inside a command (which request to abort, the new request's prompt) come from the
same seeded generator, so a (spec, commands) pair always replays the same run.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import product

from tokentape.engine.config import EngineConfig
from tokentape.engine.llm_engine import LLMEngine
from tokentape.engine.model_registry import ORACLE_MODELS
from tokentape.engine.runners.oracle import OracleRunner
from tokentape.events.discard import DISCARD_POLICIES
from tokentape.events.schema import SamplingParams
from tokentape.events.store import TapeWriter

PAUSES = tuple(
    f"pause_{mode}{clear}" for mode in ("keep", "wait", "abort") for clear in ("", "_clear")
)
# Weight updates, as an RL loop makes them: pause(keep, clear_cache=True), then a whole
# versioned update, or vLLM's chunked transfer (a bad chunk refused in between, and a resume
# refused while it is open). The engine stays paused until a later resume.
WEIGHT_UPDATES = ("update_weights", "update_chunked")
# vLLM's sleep mode: sleep<level>_<pause mode>, and wake-ups of every tag (wake: all).
SLEEPS = ("sleep0_wait", "sleep1_keep", "sleep2_keep", "sleep1_abort")
WAKES = ("wake", "wake_weights", "wake_kv_cache", "wake_scheduling")
COMMANDS = (
    "step",
    "add",
    "abort",
    "abort_all",
    "resume",
    "reset",
    "reset_running",
    *PAUSES,
    *WEIGHT_UPDATES,
    *SLEEPS,
    *WAKES,
)
# How often a seeded storm draws each command: steps and adds dominate, so that requests
# progress between the disturbances while the queue stays long (KV pressure, and requests
# queued behind a head that does not fit, are the common case, not the exception).
_WEIGHTS = {
    "step": 60,
    "add": 40,
    "abort": 3,
    "resume": 8,
    "reset": 3,
    "reset_running": 4,
    **{p: (1 if p.startswith("pause_abort") else 3) for p in PAUSES},
    "update_weights": 2,
    "update_chunked": 2,
    # Aborting every request at once is rare, as pause_abort is: requests must live to finish.
    "abort_all": 0.5,
    **{c: 0.5 for c in SLEEPS},
    "wake": 6,  # wake-ups outnumber sleeps, so the engine is asleep now and then, not mostly
    **{c: 1 for c in WAKES[1:]},
}
DRAIN_LIMIT = 20_000  # steps allowed to finish every request once the storm is over


class StormError(RuntimeError):
    """The engine did not finish its requests after the storm (a hang), or a spec is invalid."""


@dataclass(frozen=True, slots=True)
class StormSpec:
    """One storm: the engine's shape and the storm's seed. The small KV cache and token budget
    are what make preemptions, chunked prefills and queueing frequent."""

    seed: int
    pipeline_depth: int = 2
    num_speculative_tokens: int = 0
    discard_policy: str = "epoch"
    num_commands: int = 2000
    model: str = "oracle"
    block_size: int = 4
    num_kv_blocks: int = 24
    max_num_batched_tokens: int = 16
    max_num_seqs: int = 4
    initial_requests: int = 3
    faults: tuple[str, ...] = ()  # upstream bugs injected (tokentape.events.faults)

    def engine_args(self) -> dict[str, object]:
        return {
            "faults": list(self.faults),
            "pipeline_depth": self.pipeline_depth,
            "num_speculative_tokens": self.num_speculative_tokens,
            "discard_policy": self.discard_policy,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "seed": self.seed,
        }


@dataclass(slots=True)
class StormResult:
    spec: StormSpec
    commands: list[str]
    tape: TapeWriter  # the recorded run (closed): a MemoryTape, or an SQLite tape's writer
    received: dict[str, list[int]] = field(default_factory=dict)  # what the client was given
    finish_reasons: dict[str, str | None] = field(default_factory=dict)
    expected: dict[str, list[int]] = field(default_factory=dict)  # the oracle's stream
    num_events: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_resets: int = 0  # prefix-cache resets that succeeded
    num_weight_updates: int = 0  # whole or chunked, each after pause(keep, clear_cache=True)

    @property
    def tape_path(self) -> str | None:
        return self.tape.path

    def oracle_violations(self) -> dict[str, str]:
        """Requests whose received stream is not the oracle's, with what is wrong: a finished
        request must have the whole stream, an aborted one a prefix of it."""
        wrong = {}
        for req_id, want in self.expected.items():
            got, reason = self.received.get(req_id, []), self.finish_reasons.get(req_id)
            if reason in ("stop", "length"):
                if got != want:
                    wrong[req_id] = f"finished ({reason}) with {got}, the oracle's stream is {want}"
            elif reason == "abort":
                if got != want[: len(got)]:
                    wrong[req_id] = f"aborted with {got}, not a prefix of the oracle's {want}"
            else:
                wrong[req_id] = f"never finished (received {len(got)} of {len(want)} tokens)"
        return wrong


def storm_commands(seed: int, n: int) -> list[str]:
    """`n` commands drawn from the seed (the same seed, the same storm)."""
    rng = random.Random(f"commands-{seed}")
    names = list(_WEIGHTS)
    return rng.choices(names, weights=[_WEIGHTS[c] for c in names], k=n)


class StormDriver:
    """Issues storm commands to an engine and records what its client receives."""

    def __init__(self, engine: LLMEngine, seed: int, result: StormResult) -> None:
        self.engine = engine
        self.rng = random.Random(f"choices-{seed}")
        self.result = result
        runner = engine.engine_core.runner
        if not isinstance(runner, OracleRunner):
            raise StormError(
                f"storms need the oracle model ({' or '.join(ORACLE_MODELS)}), "
                f"got {runner.model_id!r}"
            )
        self.oracle = runner
        self._added = 0

    def add(self) -> None:
        rng = self.rng
        req_id = f"s{self._added}"
        self._added += 1
        prompt = [rng.randrange(3, 259) for _ in range(rng.randint(2, 40))]
        stop = (rng.randrange(3 + 32, 3 + 127),) if rng.random() < 0.3 else ()
        # Mostly short requests, some long ones that hold their KV blocks for a long time.
        max_tokens = rng.randint(1, 28) if rng.random() < 0.8 else rng.randint(40, 240)
        params = SamplingParams(
            max_tokens=max_tokens,
            stop_token_ids=stop,
            seed=rng.randrange(1 << 32) if rng.random() < 0.3 else None,
        )
        self.engine.add_request(req_id, prompt, params)
        self.result.expected[req_id] = self.oracle.expected_stream(
            prompt, params, self.engine.config.effective_max_model_len
        )
        self.result.received[req_id] = []
        self.result.finish_reasons[req_id] = None

    def step(self) -> None:
        for out in self.engine.step():
            completion = out.outputs[0]
            self.result.received[out.request_id] = list(completion.token_ids)  # cumulative
            if out.finished:
                self.result.finish_reasons[out.request_id] = completion.finish_reason

    def issue(self, command: str) -> None:
        engine = self.engine
        if command == "step":
            self.step()
        elif command == "add":
            self.add()
        elif command == "abort":
            unfinished = engine.engine_core.state.unfinished
            if unfinished:
                engine.abort_request(self.rng.choice(unfinished).req_id)
        elif command == "abort_all":
            engine.abort_all()
        elif command == "resume":
            self._unless_asleep(engine.resume_generation)
        elif command in ("reset", "reset_running"):
            engine.reset_prefix_cache(reset_running_requests=command == "reset_running")
        elif command in PAUSES:
            _, mode, *clear = command.split("_")
            self._unless_asleep(lambda: engine.pause_generation(mode, clear_cache=bool(clear)))
        elif command in WEIGHT_UPDATES:
            self.update_weights(chunked=command == "update_chunked")
        elif command in SLEEPS:
            level, mode = command.removeprefix("sleep").split("_")
            engine.sleep(int(level), mode)
        elif command in WAKES:
            engine.wake_up(None if command == "wake" else [command.removeprefix("wake_")])
        else:
            raise StormError(f"unknown storm command {command!r} (commands: {', '.join(COMMANDS)})")

    def _unless_asleep(self, call: Callable[[], None]) -> None:
        """A call the engine refuses while it sleeps: refused then, with nothing recorded."""
        state = self.engine.engine_core.state
        if state.sleep_level is None:
            call()
            return
        before = state.num_events
        try:
            call()
        except RuntimeError:
            if state.num_events != before:
                raise StormError("a call refused while asleep recorded events") from None
        else:
            raise StormError("a call that needs an awake engine ran while it slept")

    def update_weights(self, chunked: bool) -> None:
        """New oracle weights (its tokens ignore them: every stream must stay the oracle's),
        versioned by name or by number, whole or in a transfer of two chunks."""
        from tokentape.engine.runners.oracle_weights import oracle_state_dict

        engine, rng = self.engine, self.rng
        engine.wake_up()  # asleep, it wakes first (the RL order around a sleep: tests/engine)
        engine.pause_generation("keep", clear_cache=True)
        weights = oracle_state_dict(rng.randrange(1 << 16))
        version = f"step-{self.result.num_weight_updates}" if rng.random() < 0.5 else None
        self.result.num_weight_updates += 1
        if not chunked:
            engine.update_weights(weights, weight_version=version)
            return
        engine.start_weight_update()
        for name, tensor in weights.items():
            engine.update_weights({name: tensor})
            if rng.random() < 0.3:  # a chunk of the wrong shape: refused, nothing held
                try:
                    engine.update_weights({name: tensor[:1]})
                except ValueError:
                    pass
                else:
                    raise StormError(f"a chunk of the wrong shape for {name!r} was taken")
        if rng.random() < 0.3:
            try:
                engine.resume_generation()
            except RuntimeError:
                pass
            else:
                raise StormError("resume_generation went through with a transfer open")
        engine.finish_weight_update(weight_version=version)

    def drain(self, limit: int = DRAIN_LIMIT) -> None:
        """Wake up, resume and step until every request has finished and been delivered."""
        self.engine.wake_up()
        self.engine.resume_generation()
        for _ in range(limit):
            if not self.engine.has_unfinished_requests():
                return
            self.step()
        unfinished = [r.req_id for r in self.engine.engine_core.state.unfinished]
        raise StormError(
            f"storm seed {self.result.spec.seed}: {len(unfinished)} requests still "
            f"unfinished after {limit} steps ({', '.join(unfinished[:8])})"
        )


def run_storm(
    spec: StormSpec,
    commands: Sequence[str] | None = None,
    tape: str | os.PathLike[str] | None = None,
) -> StormResult:
    """Run one storm to the end (every request finished) and return what the client received.
    `commands` defaults to `storm_commands(spec.seed, spec.num_commands)`; `tape` is a path for
    an SQLite tape (default: in memory). An engine failure propagates (it is on the tape)."""
    if spec.discard_policy not in DISCARD_POLICIES:
        raise StormError(f"unknown discard policy {spec.discard_policy!r}")
    if spec.model not in ORACLE_MODELS:
        raise StormError(
            f"storms need the oracle model ({' or '.join(ORACLE_MODELS)}), got {spec.model!r}"
        )
    names = list(commands) if commands is not None else storm_commands(spec.seed, spec.num_commands)
    bad = [c for c in names if c not in COMMANDS]
    if bad:
        raise StormError(f"unknown storm command {bad[0]!r} (commands: {', '.join(COMMANDS)})")
    config = EngineConfig(model=spec.model, **spec.engine_args())  # type: ignore[arg-type]
    engine = LLMEngine.from_engine_args(config, tape)
    result = StormResult(spec, names, engine.engine_core.tape)
    try:
        driver = StormDriver(engine, spec.seed, result)
        for _ in range(spec.initial_requests):
            driver.add()
        for command in names:
            driver.issue(command)
        driver.drain()
    finally:
        engine.close()
    state = engine.engine_core.state
    result.num_events = state.num_events
    result.num_steps = state.step
    result.num_preemptions = sum(r.num_preemptions for r in state.requests.values())
    result.num_resets = state.num_prefix_cache_resets
    return result


def storm_grid(
    seeds: Sequence[int],
    depths: Sequence[int] = (1, 2, 3, 4),
    speculative: Sequence[int] = (0, 1, 2, 3),
    policies: Sequence[str] = tuple(DISCARD_POLICIES),
    base: StormSpec | None = None,
) -> Iterator[StormSpec]:
    """Every (policy, depth, speculative tokens, seed) combination, as specs."""
    base = base if base is not None else StormSpec(seed=0)
    for policy, depth, k, seed in product(policies, depths, speculative, seeds):
        yield replace(
            base, seed=seed, pipeline_depth=depth, num_speculative_tokens=k, discard_policy=policy
        )
