"""Dependencies point one way: jobs → gpus → portal. Read from the source, so a function-local
import that dodges a cycle counts as much as one at the top of a module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAY_NOT_IMPORT = {"portal": {"gpus", "jobs"}, "gpus": {"jobs"}}
# Project wiring composes the apps: the URL roots, settings, the Celery app, and `make run`,
# which starts a worker per GPU host.
WIRING = {
    "portal/urls.py",
    "portal/api_urls.py",
    "portal/settings.py",
    "portal/celery.py",
    "portal/management/commands/runportal.py",
}


def imported_apps(source: str) -> set[tuple[int, str]]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add((node.lineno, node.module))
    return found


def test_it_keeps_dependencies_pointing_one_way():
    wrong = []
    for app, banned in MAY_NOT_IMPORT.items():
        for path in sorted((ROOT / app).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name in WIRING or "/migrations/" in name:
                continue
            for line, module in sorted(imported_apps(path.read_text())):
                if module.split(".")[0] in banned:
                    wrong.append(f"{name}:{line} imports {module}")
    assert wrong == []


def test_it_finds_an_import_hidden_in_a_function():
    source = "def f():\n    from gpus.models import Allocation\n"
    assert (2, "gpus.models") in imported_apps(source)
