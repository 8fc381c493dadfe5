"""The bench that remembers (bench/memory.py, issue 40): figures kept per run and judged against
bench/baseline.json, times as multiples of the run's calibration."""

from __future__ import annotations

import json

from bench import memory

SLOW = {"cpu_ms": 200.0, "database_ms": 200.0}  # a machine half as fast
FAST = {"cpu_ms": 100.0, "database_ms": 100.0}


def _run(calibration: dict[str, float], **figures: tuple[float, str, str]) -> dict:
    return {
        "commit": "abc",
        "at": "2026-11-29T10:00:00Z",
        "calibration": calibration,
        "figures": {key: {"value": v, "unit": u, "goal": goal} for key, (v, u, goal) in figures.items()},
    }


def _said(run: dict, baseline: dict) -> dict[str, tuple[bool, str]]:
    return {v.key: (v.slipped, v.line) for v in memory.compare(run, baseline)}


def test_a_time_is_judged_against_the_runs_calibration():
    baseline = _run(FAST, pass_=(40.0, "ms", "<= 50 ms"))
    # Twice the time on a machine half as fast: no slip. The same time on the fast one: fine.
    assert not _said(_run(SLOW, pass_=(80.0, "ms", "<= 50 ms")), baseline)["pass_"][0]
    slipped, line = _said(_run(FAST, pass_=(52.0, "ms", "<= 50 ms")), baseline)["pass_"]
    assert slipped and "SLIPPED" in line and "1.30x" in line
    assert not _said(_run(FAST, pass_=(49.0, "ms", "<= 50 ms")), baseline)["pass_"][0]  # 1.22x


def test_a_share_is_worse_lower_and_judged_as_it_is():
    baseline = _run(FAST, lent=(56.0, "%", ">= 50 %"))
    assert _said(_run(SLOW, lent=(40.0, "%", ">= 50 %")), baseline)["lent"][0]  # 1.4x worse
    assert not _said(_run(SLOW, lent=(70.0, "%", ">= 50 %")), baseline)["lent"][0]


def test_a_count_with_no_goal_is_shown_not_judged_and_a_new_figure_has_no_baseline():
    baseline = _run(FAST, queries=(5.0, "", "(none)"))
    said = _said(_run(FAST, queries=(50.0, "", "(none)"), fresh=(3.0, "ms", "<= 5 ms")), baseline)
    assert said["queries"] == (False, "queries: 50.00 , baseline 5.00  (no goal: not judged)")
    assert said["fresh"] == (False, "fresh: 3.00 ms (new: no baseline)")


def test_goals_written_with_unicode_signs_or_as_zero_are_judged():
    baseline = _run(FAST, wrong=(0.0, "", "0"), double=(0.0, "", "= 0"), lab=(4.0, "s", "≤ 5 s"))
    baseline["figures"]["lent"] = {"value": 56.0, "unit": "%", "goal": "≥ 50 %"}
    run = _run(FAST, wrong=(1.0, "", "0"), double=(0.0, "", "= 0"), lab=(5.5, "s", "≤ 5 s"))
    run["figures"]["lent"] = {"value": 40.0, "unit": "%", "goal": "≥ 50 %"}
    said = _said(run, baseline)
    assert said["wrong"][0] and not said["double"][0] and said["lab"][0] and said["lent"][0]
    equal = _said(_run(FAST, mib=(900.0, "MB", "= 1024")), _run(FAST, mib=(1024.0, "MB", "= 1024")))
    assert not equal["mib"][0] and "not judged" in equal["mib"][1]


def test_a_time_without_a_goal_is_better_lower():
    baseline = _run(FAST, api=(100.0, "ms", "(none)"))
    assert _said(_run(FAST, api=(130.0, "ms", "(none)")), baseline)["api"][0]


def test_a_tail_without_a_goal_is_shown_not_judged_and_one_with_a_goal_is():
    baseline = _run(FAST, **{"pass, warm, p90": (47.0, "ms", "(none)"), "wait, max": (2.0, "s", "<= 3 s")})
    said = _said(
        _run(FAST, **{"pass, warm, p90": (104.0, "ms", "(none)"), "wait, max": (2.6, "s", "<= 3 s")}),
        baseline,
    )
    assert said["pass, warm, p90"] == (
        False,
        "pass, warm, p90: 104.00 ms, baseline 47.00 ms (a tail, no goal: not judged)",
    )
    assert said["wait, max"][0]  # 1.3x: a promise, judged


def test_figures_are_recorded_under_their_script_and_the_last_value_wins(tmp_path, monkeypatch):
    record = tmp_path / "figures.jsonl"
    monkeypatch.setenv(memory.RECORD_ENV, str(record))
    monkeypatch.setenv(memory.SCRIPT_ENV, "bench_queue")
    monkeypatch.setattr(memory, "RUNS", tmp_path / "runs")
    memory.record("scheduler pass, warm ", 90.0, "ms", "<= 50 ms")
    memory.record("scheduler pass, warm", 60.0, "ms", "<= 50 ms")
    run = json.loads(memory.run_write(record, FAST, "sqlite").read_text())
    kept = {"value": 60.0, "unit": "ms", "goal": "<= 50 ms"}
    assert run["figures"] == {"bench_queue: scheduler pass, warm": kept}
    assert run["calibration"] == FAST and run["database"] == "sqlite"


def test_nothing_is_recorded_outside_make_bench(tmp_path, monkeypatch):
    monkeypatch.delenv(memory.RECORD_ENV, raising=False)
    memory.record("x", 1.0, "ms", "")  # no file, no error
