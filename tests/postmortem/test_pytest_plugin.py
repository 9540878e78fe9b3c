"""The pytest plugin, run in a pytester session: tapes of failing tests only, a postmortem
report beside each, both paths in the JUnit XML."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = """
from tokentape import LLM, SamplingParams


def flag_run(**kw):
    llm = LLM(model="oracle-random", discard_policy="flag", block_size=4, num_kv_blocks=64, **kw)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm.llm_engine.add_request("r", list(range(10, 30)), params)
    for _ in range(6):
        llm.llm_engine.step()
    llm.llm_engine.pause_generation("keep", True)
    llm.llm_engine.step()
    llm.llm_engine.resume_generation()
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    return llm


def test_fails_with_a_memory_tape():
    llm = flag_run()
    runner = llm.llm_engine.engine_core.runner
    expected = runner.expected_stream(list(range(10, 30)), SamplingParams(max_tokens=16))
    assert llm.llm_engine.engine_core.state.requests["r"].output_token_ids == expected


def test_fails_with_a_file_tape(tmp_path):
    flag_run(tape=str(tmp_path / "mine.tape"))
    LLM(model="oracle", tape=None).generate("hi", SamplingParams(max_tokens=3))
    raise RuntimeError("boom")


def test_passes():
    llm = LLM(model="oracle")
    assert len(llm.generate("hi", SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4


def test_fails_without_an_engine():
    assert 1 == 2
"""


def test_plugin_keeps_the_tapes_of_failing_tests(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile(test_sample=TESTS)
    keep = tmp_path / "tapes"
    junit = tmp_path / "junit.xml"
    result = pytester.runpytest(
        "--tokentape-dir", str(keep), f"--junitxml={junit}", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(["*tokentape: tapes of failing tests*"])
    names = sorted(p.name for p in keep.iterdir())
    assert names == [
        "test_sample.py_test_fails_with_a_file_tape-0.html",
        "test_sample.py_test_fails_with_a_file_tape-0.tape",
        "test_sample.py_test_fails_with_a_file_tape-1.html",
        "test_sample.py_test_fails_with_a_file_tape-1.tape",
        "test_sample.py_test_fails_with_a_memory_tape.html",
        "test_sample.py_test_fails_with_a_memory_tape.tape",
    ]
    from tokentape.postmortem import postmortem

    report = postmortem(keep / "test_sample.py_test_fails_with_a_memory_tape.tape")
    assert "post_resume_token_dropped" in {f.kind for f in report.findings}
    html = (keep / "test_sample.py_test_fails_with_a_memory_tape.html").read_text()
    assert "post_resume_token_dropped" in html and "<svg" in html

    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    props = {
        name: {p.get("name"): p.get("value") for p in case.iter("property")}
        for name, case in cases.items()
    }
    assert props["test_fails_with_a_memory_tape"] == {
        "tokentape_tape": str(keep / "test_sample.py_test_fails_with_a_memory_tape.tape"),
        "tokentape_report": str(keep / "test_sample.py_test_fails_with_a_memory_tape.html"),
    }
    assert props["test_passes"] == {} and props["test_fails_without_an_engine"] == {}
    assert (
        len(props["test_fails_with_a_file_tape"]) == 2
    )  # two engines: the last pair wins the name
    # The test's own tape file is untouched; the kept copy reads back whole.
    assert "post_resume_token_dropped" in {
        f.kind
        for f in postmortem(keep / "test_sample.py_test_fails_with_a_file_tape-0.tape").findings
    }


def test_plugin_is_off_without_the_option(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile(test_sample=TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=3)
    assert "tokentape: tapes" not in result.stdout.str()
