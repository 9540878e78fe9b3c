"""Issue 25's checkers, the sleep races' included, give no false positive: 800 clean chaos
storms (the default `epoch` policy, each seed drawing its engine's shape as `tokentape chaos`
does: pipeline depth 1-4, speculative tokens 0-3, KV caches of 12-32 blocks, 2-8 sequences,
budgets of 8-32 tokens), short ones, in this process, each asked only these checkers'
questions (run_checkers: one pass, no replay). The museum tapes (tests/tapes/,
test_museum.py) show each one firing."""

from __future__ import annotations

from tokentape.chaos import run_storm
from tokentape.chaos.campaign import ChaosOptions, chaos_spec
from tokentape.events import schema as ev
from tokentape.postmortem.admission import AdmissionChecker
from tokentape.postmortem.analysis import run_checkers
from tokentape.postmortem.kv import KVChecker
from tokentape.postmortem.positions import PositionChecker
from tokentape.postmortem.sleep import SleepChecker

STORMS = 800
COMMANDS = 200  # per storm; the storm drains its requests after them


def test_no_false_positive_on_800_clean_storms() -> None:
    options = ChaosOptions("epoch", num_commands=COMMANDS)
    findings: dict[int, list[str]] = {}
    frames = preempted_in_flight = sleeps = added_asleep = 0
    for seed in range(STORMS):
        result = run_storm(chaos_spec(seed, options))
        asleep = False
        for _, e in result.tape.iter_events():
            if isinstance(e, ev.RequestPreempted) and e.in_flight:
                preempted_in_flight += 1  # blocks given back while a step writes them
            elif isinstance(e, ev.FrameProduced):
                frames += len(e.entries)
            elif isinstance(e, ev.EngineSlept):
                sleeps += e.level > 0  # memory released (each drained first)
                asleep = True
            elif isinstance(e, ev.GenerationResumed):
                asleep = False
            elif isinstance(e, ev.RequestAdded):
                added_asleep += asleep  # queued, to be served after the wake-up
        found = run_checkers(
            result.tape, [AdmissionChecker, PositionChecker, KVChecker, SleepChecker]
        )
        if found:
            findings[seed] = [f"{f.kind}: {f.message}" for f in found]
    assert findings == {}
    # The storms did what the checkers look at: frames (with positions) by the thousand, and
    # blocks handed back with a step still writing them.
    assert frames > 100_000 and preempted_in_flight > 1_000
    # ... and sleeps that released memory, with requests added while the engine slept.
    assert sleeps > 100 and added_asleep > 100, (sleeps, added_asleep)
