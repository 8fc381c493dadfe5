"""The rooms of the jobs app (issue 32, docs/development.md "The rooms"): the code a GPU host's
worker runs lives in jobs/host/, apart from what serves the web, and only named doors lead in."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Who outside jobs/host/ may import it, and why (docs/development.md says the same).
DOORS = {
    "jobs/signals.py": "starts a host's threads and its watchdog at worker start",
    "jobs/tasks.py": "the Celery tasks a host's worker runs (run_job, run_session)",
    "jobs/threads.py": "the host's spool replay thread",
    "jobs/runs.py": "the spool's record of an end (EndRecord), replayed when the database is back",
    "jobs/logs/store.py": "LogWriter spools what the database cannot take (LogSpool)",
    "jobs/prometheus/metrics.py": "DCGM's names for a job and a session, so both label alike",
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _project_modules() -> list[Path]:
    """The project's own Python packages: every top-level folder with an __init__.py (walking the
    whole checkout would read the virtual environment's tens of thousands of files)."""
    packages = [p.parent for p in ROOT.glob("*/__init__.py")]
    return sorted(path for package in packages for path in package.rglob("*.py"))


def test_only_the_named_doors_lead_into_the_hosts_room():
    entering = set()
    for path in _project_modules():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("jobs/host/", "tests/", "bench/")) or "/migrations/" in rel:
            continue
        if any(name == "jobs.host" or name.startswith("jobs.host.") for name in _imports(path)):
            entering.add(rel)
    assert entering <= set(DOORS), f"new doors into jobs/host/: {sorted(entering - set(DOORS))}"


def test_no_web_module_is_in_the_hosts_room():
    """Nothing in jobs/host/ answers a request: no view, no API (a link in a notification may be
    reversed)."""
    for path in (ROOT / "jobs" / "host").rglob("*.py"):
        web = {n for n in _imports(path) if n.split(".")[0] == "rest_framework"}
        web |= {"django.http", "django.shortcuts", "django.views.decorators.http"} & _imports(path)
        assert not web, f"{path.relative_to(ROOT)} imports {sorted(web)}"
