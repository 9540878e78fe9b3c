"""The postmortem: the bug zoo's findings exactly, clean tapes without any, the other
checkers against faults injected into a real engine, bad input, the CLI and the HTML report."""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokentape import LLM, SamplingParams
from tokentape.chaos import COMMANDS, StormSpec, run_storm
from tokentape.cli import main
from tokentape.engine.core.kv_cache_manager import KVCacheManager
from tokentape.engine.fault_hooks import FaultInjectingEngineCore
from tokentape.engine.hooks import EngineHooks
from tokentape.engine.llm_engine import LLMEngine
from tokentape.events import schema as ev
from tokentape.events.sqlite_store import SQLiteTape
from tokentape.postmortem import postmortem
from tokentape.postmortem.findings import BUG_CLASSES, Report
from tokentape.postmortem.fleet import fleet_postmortem
from tokentape.postmortem.report_html import render_report
from tokentape.replay import load_tape

TAPES = Path(__file__).resolve().parents[1] / "tapes"
ZOO = sorted(p.name.removesuffix(".expected.json") for p in TAPES.glob("*.expected.json"))


def found(report: Report) -> list[tuple[str, str, tuple[str, ...], str | None]]:
    return sorted((f.kind, f.severity, tuple(f.request_ids), f.bug_class) for f in report.findings)


def kinds(report: Report) -> set[str]:
    return {f.kind for f in report.findings}


# -- the zoo -------------------------------------------------------------------------------


def test_the_zoo_has_every_bug_class_and_clean_tapes() -> None:
    expected = {n: json.loads((TAPES / f"{n}.expected.json").read_text()) for n in ZOO}
    classes = {f["bug_class"] for doc in expected.values() for f in doc["findings"]}
    assert {
        "vllm#42043",
        "vllm#42117-overwrite",
        "vllm#42117-spec-units",
        "vllm#47900",
        "vllm#26400",
    } <= classes
    assert sum(not doc["findings"] for doc in expected.values()) >= 2  # clean tapes
    assert classes - {None} <= set(BUG_CLASSES)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_tape_gives_exactly_its_findings(name: str) -> None:
    tape = TAPES / f"{name}.tape"
    assert tape.stat().st_size < 200_000
    expected = json.loads((TAPES / f"{name}.expected.json").read_text())["findings"]
    report = postmortem(tape)
    assert report.summary.complete
    assert found(report) == sorted(
        (f["kind"], f["severity"], tuple(f["request_ids"]), f["bug_class"]) for f in expected
    )
    assert report.ok == (not any(f["severity"] == "error" for f in expected))
    for f in report.findings:  # every finding is placed and shown
        assert 0 <= f.steps[0] <= f.steps[1] <= report.summary.num_steps
        assert f.message and "\n" not in f.message
        assert f.excerpt or f.kind in ("token_mismatch",)


@pytest.mark.parametrize("name", ZOO)
def test_the_regeneration_script_records_the_same_bugs(name: str, tmp_path: Path) -> None:
    """tests/tapes/regenerate.py (run when the format changes) records each bug again."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("regenerate", TAPES / "regenerate.py")
    assert spec is not None and spec.loader is not None
    regenerate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regenerate)
    scenario, expected = regenerate.ZOO[name]
    scenario(tmp_path / "again.tape")
    assert found(postmortem(tmp_path / "again.tape")) == sorted(
        (f["kind"], f["severity"], tuple(f["request_ids"]), f["bug_class"]) for f in expected
    )
    assert json.loads((TAPES / f"{name}.expected.json").read_text())["findings"] == expected


def test_flag_finding_cites_the_preemption_the_resume_and_the_dropped_frame() -> None:
    report = postmortem(TAPES / "flag_42043.tape")
    f = next(f for f in report.findings if f.kind == "post_resume_token_dropped")
    assert [x.kind for x in f.excerpt] == [
        "RequestPreempted",
        "GenerationResumed",
        "StepScheduled",
        "FrameProduced",
    ]
    assert report.summary.tokens["dropped_fresh"] == 1
    t = report.summary.tokens
    assert t["produced"] == t["applied"] + t["dropped_stale"] + t["dropped_fresh"] + t["after_stop"]


STORM = StormSpec(
    seed=0,
    model="oracle-random",
    block_size=4,
    num_kv_blocks=24,
    max_num_batched_tokens=16,
    max_num_seqs=3,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    commands=st.lists(st.sampled_from(COMMANDS), min_size=4, max_size=50),
    depth=st.integers(1, 3),
    k=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_epoch_storms_give_no_finding(commands: list[str], depth: int, k: int, seed: int) -> None:
    """No false positives: whatever the storm of pauses, resumes, resets and aborts, an
    epoch-policy run is clean, and the tape's tokens are all accounted for."""
    result = run_storm(
        replace(STORM, seed=seed, pipeline_depth=depth, num_speculative_tokens=k), commands
    )
    assert result.oracle_violations() == {}
    report = postmortem(result.tape)
    assert report.findings == []
    t = report.summary.tokens
    assert t["produced"] == t["applied"] + t["dropped_stale"] + t["dropped_fresh"] + t["after_stop"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    commands=st.lists(st.sampled_from(COMMANDS), min_size=4, max_size=50),
    depth=st.integers(2, 3),
    k=st.integers(0, 2),
    policy=st.sampled_from(["flag", "counter"]),
    seed=st.integers(0, 2**16),
)
def test_a_wrong_stream_never_goes_unreported(
    commands: list[str], depth: int, k: int, policy: str, seed: int
) -> None:
    """No false negatives: under the historical policies, whenever a request's delivered
    tokens are not the oracle's stream (a prefix of it, if aborted), the report has an error
    naming it, with the bug class it matches."""
    result = run_storm(
        replace(
            STORM, seed=seed, pipeline_depth=depth, num_speculative_tokens=k, discard_policy=policy
        ),
        commands,
    )
    wrong = result.oracle_violations()
    report = postmortem(result.tape)
    if wrong:
        assert not report.ok
        classes: dict[str, set[str | None]] = {}
        for f in report.findings:
            if f.severity == "error":
                for r in f.request_ids:
                    classes.setdefault(r, set()).add(f.bug_class)
        assert all(classes.get(r, set()) - {None} for r in wrong), (wrong, report.findings)


def test_the_same_storm_under_the_historical_policies_is_caught() -> None:
    commands = (
        ["step"] * 5 + ["pause_keep_clear", "step", "resume"] + ["step"] * 4 + ["reset_running"]
    )
    for policy in ("flag", "counter"):
        result = run_storm(
            replace(STORM, pipeline_depth=2, num_speculative_tokens=2, discard_policy=policy),
            commands,
        )
        report = postmortem(result.tape)
        assert not report.ok, policy
        assert kinds(report) & {
            "post_resume_token_dropped",
            "fresh_frame_dropped",
            "stale_frame_applied",
        }


def test_cli_help_lists_postmortem(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "postmortem" in capsys.readouterr().out
    assert main(["postmortem", "--help"]) == 0
    out = capsys.readouterr().out
    for fragment in ("TAPE", "--html", "--json", "--reference", "exit status"):
        assert fragment in out


# -- the other checkers, on faults injected into a real engine -------------------------------


def small_llm(tmp_path: Path, **kw: object) -> LLM:
    args: dict[str, object] = {
        "model": "oracle-random",
        "block_size": 4,
        "num_kv_blocks": 64,
        "tape": str(tmp_path / "run.tape"),
    }
    args.update(kw)
    return LLM(**args)  # type: ignore[arg-type]


def run_steps(llm: LLM, limit: int) -> None:
    for _ in range(limit):
        if not llm.llm_engine.has_unfinished_requests():
            return
        try:
            llm.llm_engine.step()
        except RuntimeError:
            return  # the injected fault broke the engine: the tape holds the failure


class LeakyKV(KVCacheManager):
    """A real KV cache manager that never gives a preempted or finished request's blocks
    back."""

    def free(self, req_id: str, block_ids: list[int]) -> None:
        self._num_cached.pop(req_id, None)


class RefcountBlindKV(KVCacheManager):
    """A real KV cache manager that returns blocks to the free queue whatever other requests
    still hold them."""

    def free(self, req_id: str, block_ids: list[int]) -> None:
        self._num_cached.pop(req_id, None)
        for b in block_ids:
            self.ref_cnt[b] = 0
            self.free_queue[b] = None


def with_kv(llm: LLM, kv_type: type[KVCacheManager]) -> None:
    """Swap the engine's (still empty) KV cache manager for a faulty one of the same shape."""
    kv = llm.llm_engine.engine_core.kv
    assert kv.num_used_blocks == 0
    faulty = kv_type(kv.num_blocks, kv.block_size, kv.enable_prefix_caching)
    llm.llm_engine.engine_core.kv = llm.llm_engine.engine_core.scheduler.kv = faulty


def test_kv_leak_is_found(tmp_path: Path) -> None:
    llm = small_llm(tmp_path, num_kv_blocks=120, max_num_batched_tokens=16)
    with_kv(llm, LeakyKV)
    for i in range(16):
        llm.llm_engine.add_request(
            f"q{i}", list(range(3 + i, 15 + i)), SamplingParams(max_tokens=20, ignore_eos=True)
        )
    run_steps(llm, 400)
    llm.close()
    report = postmortem(tmp_path / "run.tape")
    assert "kv_block_leaked" in kinds(report)
    assert not report.ok


def test_kv_block_handed_out_twice_is_found(tmp_path: Path) -> None:
    llm = small_llm(tmp_path, max_num_batched_tokens=64, num_kv_blocks=10)
    with_kv(llm, RefcountBlindKV)
    shared = list(range(40, 52))  # three full blocks both prompts share
    llm.llm_engine.add_request("a", shared + [7], SamplingParams(max_tokens=3, ignore_eos=True))
    run_steps(llm, 2)
    llm.llm_engine.add_request("b", shared + [8, 9], SamplingParams(max_tokens=12, ignore_eos=True))
    run_steps(llm, 4)  # a finishes and gives the shared blocks back while b holds them
    llm.llm_engine.add_request(
        "c", list(range(60, 90)), SamplingParams(max_tokens=4, ignore_eos=True)
    )
    run_steps(llm, 50)
    llm.close()
    report = postmortem(tmp_path / "run.tape")
    twice = [f for f in report.findings if f.kind == "kv_block_freed_twice"]
    assert [f.request_ids for f in twice] == [["b", "c"]]
    assert "while request 'b' still held it" in twice[0].message


def test_clean_kv_runs_have_no_kv_findings(tmp_path: Path) -> None:
    llm = small_llm(tmp_path, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4)
    shared = list(range(40, 48))
    for i in range(6):
        llm.llm_engine.add_request(
            f"q{i}", shared + list(range(i, i + 5)), SamplingParams(max_tokens=12, ignore_eos=True)
        )
    run_steps(llm, 500)
    llm.close()
    report = postmortem(tmp_path / "run.tape")
    assert report.findings == []
    assert load_tape(tmp_path / "run.tape").fold().num_prefix_cache_resets == 0


def test_prefix_cache_reset_while_blocks_in_use_is_found(tmp_path: Path) -> None:
    llm = small_llm(tmp_path)
    llm.llm_engine.add_request(
        "a", list(range(10, 30)), SamplingParams(max_tokens=8, ignore_eos=True)
    )
    run_steps(llm, 3)
    # Fault: an engine that reports a successful reset without preempting anyone.
    with llm.llm_engine.engine_core._recorded():
        llm.llm_engine.engine_core._emit(
            ev.PrefixCacheReset(llm.llm_engine.engine_core.state.step, False, True)
        )
    run_steps(llm, 50)
    llm.close()
    report = postmortem(tmp_path / "run.tape")
    assert found(report) == [("prefix_cache_reset_in_use", "error", ("a",), None)]


class NeverAdmits(EngineHooks):
    """Fault: request 'x' is never admitted, whatever room there is (admission passes over a
    parked request, as over a sleeping fault's)."""

    def admission_candidates(self, waiting: list[str]) -> list[str]:
        return [r for r in waiting if r != "x"]


def test_stuck_request_is_found(tmp_path: Path) -> None:
    llm = small_llm(tmp_path, pipeline_depth=1)
    core = llm.llm_engine.engine_core  # the same engine again, with a fault of the test's own
    faulty = FaultInjectingEngineCore(
        core.config, core.runner, core.tape, core.tokenizer, hooks=[NeverAdmits()]
    )
    llm.llm_engine = LLMEngine(faulty)
    llm.llm_engine.add_request("long", [5, 6, 7], SamplingParams(max_tokens=260, ignore_eos=True))
    llm.llm_engine.add_request("x", [8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(260):
        llm.llm_engine.step()
    llm.close()
    report = postmortem(tmp_path / "run.tape")
    assert found(report) == [
        # The engine-wide view of the same stall (postmortem/admission.py), an error.
        ("admission_stalled", "error", ("x",), "vllm#53130"),
        ("replay_diverged", "error", ("long", "x"), None),
        ("request_stuck", "warning", ("x",), None),
        ("tape_truncated", "warning", ("x",), None),
    ]
    by_kind = {f.kind: f for f in report.findings}
    # The faulty scheduler's first decision is where the tape stops replaying: x not admitted.
    assert by_kind["replay_diverged"].steps == (0, 0)
    assert "x: +2@0" in by_kind["replay_diverged"].message
    assert "made no progress for 200 steps" in by_kind["request_stuck"].message
    # The run was closed with x unfinished: the tape says where it ends.
    assert "1 request(s) unfinished" in by_kind["tape_truncated"].message


def test_requests_queued_behind_a_head_that_does_not_fit_are_not_stuck() -> None:
    """First come, first served: a long request holds most of the KV cache, the head of the
    queue needs more than is left, and the small requests behind it wait for hundreds of steps
    although they would fit. They are not stuck (vLLM's scheduler does the same)."""
    llm = LLM(
        model="oracle",
        tape=None,
        pipeline_depth=2,
        block_size=4,
        num_kv_blocks=80,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    engine = llm.llm_engine
    # 60 + 240 tokens: 15 to 75 of the 80 blocks while it runs.
    engine.add_request(
        "long", [3 + i % 200 for i in range(60)], SamplingParams(max_tokens=240, ignore_eos=True)
    )
    engine.step()
    # 270 tokens: 68 blocks, never free while the long request runs.
    engine.add_request(
        "head", [10 + i % 200 for i in range(270)], SamplingParams(max_tokens=4, ignore_eos=True)
    )
    for i in range(3):
        engine.add_request(f"small{i}", [5 + i, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    waited = 0
    while engine.has_unfinished_requests():
        engine.step()
        waited += "small0" in engine.engine_core.state.waiting
    assert waited > 200  # queued behind the head for the whole of the long request
    report = postmortem(engine.engine_core.tape)
    assert report.findings == []


class FailingRunner:
    """A real runner whose sixth frame never comes back (a device failure)."""

    def __init__(self, runner: object) -> None:
        self._runner = runner
        self.collected = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._runner, name)

    def collect(self, step: int) -> list[ev.FrameEntry]:
        self.collected += 1
        if self.collected == 6:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self._runner.collect(step)  # type: ignore[attr-defined, no-any-return]


def test_engine_error_is_a_finding(tmp_path: Path) -> None:
    llm = small_llm(tmp_path)
    llm.llm_engine.engine_core.runner = FailingRunner(llm.llm_engine.engine_core.runner)  # type: ignore[assignment]
    llm.llm_engine.add_request(
        "a", list(range(10, 20)), SamplingParams(max_tokens=20, ignore_eos=True)
    )
    with pytest.raises(RuntimeError, match="illegal memory access"):
        for _ in range(20):
            llm.llm_engine.step()
    llm.close()
    report = postmortem(tmp_path / "run.tape")
    assert [(f.kind, f.request_ids) for f in report.findings] == [("engine_error", ["a"])]
    assert "RuntimeError: CUDA error: an illegal memory access" in report.findings[0].message
    assert report.summary.complete and not report.ok


class InterruptedRunner(FailingRunner):
    """A real runner whose sixth frame is interrupted by a Ctrl-C."""

    def collect(self, step: int) -> list[ev.FrameEntry]:
        self.collected += 1
        if self.collected == 6:
            raise KeyboardInterrupt
        return self._runner.collect(step)  # type: ignore[attr-defined, no-any-return]


def test_a_ctrl_c_is_an_interruption_not_an_engine_failure(tmp_path: Path) -> None:
    llm = small_llm(tmp_path)
    llm.llm_engine.engine_core.runner = InterruptedRunner(llm.llm_engine.engine_core.runner)  # type: ignore[assignment]
    llm.llm_engine.add_request(
        "a", list(range(10, 20)), SamplingParams(max_tokens=20, ignore_eos=True)
    )
    with pytest.raises(KeyboardInterrupt):
        for _ in range(20):
            llm.llm_engine.step()
    llm.close()
    report = postmortem(tmp_path / "run.tape")
    assert [(f.kind, f.severity, f.request_ids) for f in report.findings] == [
        ("interrupted", "warning", ["a"])
    ]
    assert "interrupted at step" in report.findings[0].message
    assert report.ok  # exit status 0: nothing failed
    fleet = fleet_postmortem(tmp_path, jobs=1).summary
    assert fleet.engines["run"].ended == "interrupted" and fleet.ended == {"interrupted": 1}


def test_reference_tape(tmp_path: Path) -> None:
    from tape_scenarios import pause_resume

    good = pause_resume("epoch", tmp_path / "good.tape")
    bad = pause_resume("flag", tmp_path / "bad.tape")
    report = postmortem(bad, reference=good)
    assert (report.summary.reference or "").startswith("reference tape")
    assert ("token_shifted", "error", ("r",), "vllm#42043") in found(report)
    assert postmortem(good, reference=good).findings == []
    # Against a reference that ran longer, the shorter finished stream is named.
    longer = tmp_path / "longer.tape"
    with LLM(model="oracle-random", tape=str(longer), block_size=4, num_kv_blocks=64) as llm:
        llm.llm_engine.add_request(
            "r", list(range(10, 30)), SamplingParams(max_tokens=30, ignore_eos=True)
        )
        run_steps(llm, 200)
    report = postmortem(good, reference=longer)
    assert [(f.kind, f.request_ids) for f in report.findings] == [("token_mismatch", ["r"])]
    assert "with 24 tokens where the reference" in report.findings[0].message


# -- bad input -----------------------------------------------------------------------------


def copy_with(src: Path, dst: Path, sql: str, *params: object) -> None:
    src_conn = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    dst_conn = sqlite3.connect(dst)
    src_conn.backup(dst_conn)
    src_conn.close()
    dst_conn.execute("DROP TRIGGER IF EXISTS events_no_update")
    dst_conn.execute("DROP TRIGGER IF EXISTS meta_no_update")
    dst_conn.execute(sql, params)
    dst_conn.commit()
    dst_conn.close()


def test_corrupt_event_names_where_and_keeps_the_prefix(tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.tape"
    copy_with(
        TAPES / "flag_42043.tape", bad, "UPDATE events SET data = ? WHERE seq = 40", b"\xc1garbage"
    )
    report = postmortem(bad)
    damaged = [f for f in report.findings if f.kind == "tape_damaged"]
    assert len(damaged) == 1 and damaged[0].seq == 40 and "event 40" in damaged[0].message
    assert report.summary.num_events == 40 and not report.summary.complete
    # The prefix still shows the bug: the dropped first token after resume is before event 40.
    assert "post_resume_token_dropped" in kinds(report)


def test_truncated_tape_is_analysed_up_to_the_break(tmp_path: Path) -> None:
    llm = small_llm(tmp_path, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    for i in range(30):
        llm.llm_engine.add_request(
            f"q{i}", list(range(3 + i, 15 + i)), SamplingParams(max_tokens=30, ignore_eos=True)
        )
    run_steps(llm, 2000)
    llm.close()
    data = (tmp_path / "run.tape").read_bytes()
    total = len(load_tape(tmp_path / "run.tape"))
    cut = tmp_path / "cut.tape"
    cut.write_bytes(data[: len(data) * 2 // 3])
    report = postmortem(cut)
    assert not report.summary.complete
    assert 0 < report.summary.num_events < total  # the readable prefix was analysed
    assert found(report) == [("tape_damaged", "error", (), None)]
    assert f"from event {report.summary.num_events} on" in report.findings[0].message


def test_damaged_tape_still_gets_a_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "corrupt.tape"
    copy_with(
        TAPES / "flag_42043.tape", bad, "UPDATE events SET data = ? WHERE seq = 50", b"\x00\x01"
    )
    page = tmp_path / "r.html"
    # Exit 2 (the tape cannot be read to its end), after the report of the readable part.
    assert main(["postmortem", str(bad), "--html", str(page)]) == 2
    captured = capsys.readouterr()
    assert "[error] tape_damaged" in captured.out and "event 50" in captured.out
    (line,) = captured.err.splitlines()
    assert line.startswith(f"error: {bad}: the tape cannot be read from event 50 on")
    assert "tape_damaged" in page.read_text() and "<svg" in page.read_text()


def test_inconsistent_tape(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tape"
    tape = load_tape(TAPES / "clean_epoch_pause_resume.tape")
    out = SQLiteTape(bad, tape.header)
    for seq, event in tape.events():
        if seq == 30:
            out.append(ev.RequestFinished(event.step, "nobody", "stop"))
        out.append(event)
    out.close()
    report = postmortem(bad)
    assert [f.kind for f in report.findings] == ["tape_inconsistent"]
    assert report.findings[0].seq == 30 and "'nobody'" in report.findings[0].message
    # The page draws the 30 events the analysis could fold, in one pass that stops there.
    tape, read = load_tape(bad), []
    events = tape.events

    def counted(start: int = 0) -> Iterator[tuple[int, ev.Event]]:
        for seq, event in events(start):
            read.append(seq)
            yield seq, event

    tape.events = counted  # type: ignore[method-assign]
    page = render_report(report, tape)
    assert "tape_inconsistent" in page and "<svg" in page
    assert read == list(range(30))


def test_newer_format_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    newer = tmp_path / "newer.tape"
    copy_with(
        TAPES / "flag_42043.tape",
        newer,
        "UPDATE meta SET value = ? WHERE key = 'format_version'",
        ev.FORMAT_VERSION + 1,
    )
    assert main(["postmortem", str(newer)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "newer" in err and "\n" not in err


def test_not_a_tape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.tape"
    junk.write_text("hello")
    assert main(["postmortem", str(junk)]) == 2
    assert capsys.readouterr().err.startswith("error: ")


# -- CLI -----------------------------------------------------------------------------------


def test_cli_json_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["postmortem", str(TAPES / "flag_42043.tape"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"findings", "summary"}
    first = doc["findings"][0]
    assert {"kind", "severity", "request_ids", "steps", "message", "excerpt", "bug_class"} <= set(
        first
    )
    assert doc["summary"]["errors"] == 2 and doc["summary"]["warnings"] == 2
    assert main(["postmortem", str(TAPES / "clean_epoch_storm.tape"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []


def test_cli_text_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_html = tmp_path / "r.html"
    assert (
        main(["postmortem", str(TAPES / "counter_spec_units.tape"), "--html", str(out_html)]) == 1
    )
    text = capsys.readouterr().out
    assert "[error] fresh_frame_dropped" in text
    assert f"  matches {BUG_CLASSES['vllm#42117-spec-units']}\n" in text  # the issue named once
    assert f"report: {out_html}" in text
    page = out_html.read_text()
    assert "<svg" in page and "fresh_frame_dropped" in page
    # The one overwrite rule: an existing report is refused before any analysis, unless --force.
    assert main(["postmortem", str(TAPES / "flag_42043.tape"), "--html", str(out_html)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "the file exists; pass --force to overwrite it" in captured.err
    assert out_html.read_text() == page
    assert (
        main(["postmortem", str(TAPES / "flag_42043.tape"), "--html", str(out_html), "--force"])
        == 1
    )
    assert "post_resume_token_dropped" in out_html.read_text()
    tape = TAPES / "flag_42043.tape"
    assert main(["postmortem", str(tape), "--html", str(tape), "--force"]) == 2
    assert "--html names the input" in capsys.readouterr().err


def test_the_text_report_reads_as_english(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["postmortem", str(TAPES / "flag_42043.tape")]) == 1
    text = capsys.readouterr().out
    head = text.splitlines()[0]
    assert ", 1 request, " in head or ", 2 requests, " in head
    assert "error(s)" not in text and "warning(s)" not in text and "1 requests" not in text
    report = postmortem(TAPES / "flag_42043.tape")
    errors, warnings = report.summary.errors, report.summary.warnings
    assert (
        f"{errors} error{'s' if errors != 1 else ''}, "
        f"{warnings} warning{'s' if warnings != 1 else ''}\n" in text
    )
    assert "matches vllm#" not in text and text.count("vLLM #42043: vLLM #42043") == 0


# -- the HTML report -----------------------------------------------------------------------


def hostile_tape(tmp_path: Path) -> Path:
    """A flag-policy pause/resume whose request id is markup."""
    llm = small_llm(tmp_path, discard_policy="flag")
    rid = '<script>alert("x")</script>&'
    llm.llm_engine.add_request(
        rid, list(range(10, 30)), SamplingParams(max_tokens=16, ignore_eos=True)
    )
    for _ in range(6):
        llm.llm_engine.step()
    llm.llm_engine.pause_generation("keep", True)
    llm.llm_engine.step()
    llm.llm_engine.resume_generation()
    run_steps(llm, 100)
    llm.close()
    return tmp_path / "run.tape"


def test_html_escapes_the_tape_and_needs_no_network(tmp_path: Path) -> None:
    tape = load_tape(hostile_tape(tmp_path))
    page = render_report(postmortem(tape), tape)
    assert '<script>alert("x")' not in page and "&lt;script&gt;alert(" in page
    assert page.count("<script>") == 1  # the report's own, inline
    for remote in ("http://", "https://", " src=", "@import", "url("):
        assert remote not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert 'class="span paused"' in page and 'class="marker discarded fresh"' in page
    assert 'class="finding-mark error"' in page and 'class="marker reset"' in page
    assert "<th>expected</th>" in page and 'class="differs"' in page


def test_html_report_opens_in_headless_chromium(tmp_path: Path) -> None:
    import subprocess

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed here (.ci/run installs Debian's chromium in CI)")
    tape = load_tape(hostile_tape(tmp_path))
    page = tmp_path / "report.html"
    page.write_text(render_report(postmortem(tape), tape))
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == []
    assert 'data-timeline="drawn ' in proc.stdout  # the page's script measured the laid-out SVG
    spans = int(proc.stdout.split('data-timeline="drawn ')[1].split()[0])
    assert spans > 3


def test_html_first_error_links_to_that_finding_when_a_warning_comes_first() -> None:
    tape = load_tape(TAPES / "flag_42043.tape")
    report = postmortem(tape)
    warning = next(f for f in report.findings if f.severity == "warning")
    errors = [f for f in report.findings if f.severity == "error"]
    reordered = msgspec.structs.replace(report, findings=[warning, *errors])
    page = render_report(reordered, tape)
    assert f'First error: <a href="#finding-1">{errors[0].kind}</a>' in page
