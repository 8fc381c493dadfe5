"""Job submission has one home, jobs/submit.py (issue 20): one path of named steps for booked and
queued jobs, each rule written once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jobs import services, submit
from jobs.submit import _check_mirrored
from portal.errors import Invalid

ROOT = Path(__file__).resolve().parent.parent


def test_services_keeps_no_submit_names():
    for name in ("job_submit", "ScriptUpload", "parse_args", "parse_env", "_Place", "_check_booking"):
        assert not hasattr(services, name), name
        assert hasattr(submit, name), name


def test_the_mirrored_strategy_rule_is_written_once():
    sources = [p for p in (ROOT / "jobs").glob("*.py") if "MirroredStrategy needs" in p.read_text()]
    assert [p.name for p in sources] == ["submit.py"]
    tree = ast.parse((ROOT / "jobs" / "submit.py").read_text())
    raises = [n for n in ast.walk(tree) if isinstance(n, ast.Raise) and "MirroredStrategy" in ast.unparse(n)]
    assert len(raises) == 1


@pytest.mark.parametrize(
    ("queued", "fix"),
    [
        (True, "two or more cards; ask for more, or untick it"),
        (False, "a booking of two or more cards; untick it"),
    ],
)
def test_the_mirrored_strategy_rule_names_the_fix_for_each_kind(queued, fix):
    _check_mirrored(True, 2, queued=queued)
    with pytest.raises(Invalid, match=f"MirroredStrategy needs {fix}"):
        _check_mirrored(True, 1, queued=queued)
