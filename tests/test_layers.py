"""Dependencies point one way: jobs → gpus → portal. Read from the source, so a function-local
import that dodges a cycle counts as much as one at the top of a module.

Four views of the same rule: module imports (no upward import, no cycle, no import hidden in a
function), templates (no lower app's template naming a higher app's templates or tag
libraries) and migrations (no lower app's migration depending on a higher app's).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK = {"portal": 0, "gpus": 1, "jobs": 2}
MAY_NOT_IMPORT = {"portal": {"gpus", "jobs"}, "gpus": {"jobs"}}
# The packages whose modules make the import graph (gpu_cli stands alone; it must not cycle either).
PACKAGES = ("portal", "gpus", "jobs", "gpu_cli")
# Project wiring composes the apps: the URL roots, settings and the Celery app.
WIRING = {
    "portal/urls.py",
    "portal/api_urls.py",
    "portal/settings.py",
    "portal/celery.py",
    "portal/asgi.py",  # the ASGI application: Django behind the labs' proxy (jobs.sessions.lab_proxy)
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


# --- (a) the module graph: no cycle, and no project import inside a function ------------------


def project_modules() -> dict[str, Path]:
    """Dotted name → file, for every module of the project's packages (not migrations, nor the
    launcher's folder, which is no package)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "migrations" in parts or not all(part.isidentifier() for part in parts):
                continue
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


class _Imports(ast.NodeVisitor):
    """Every import of a module as (line, dotted name, where): `top`, `function`, `ready` (inside an
    AppConfig.ready()) or `typing` (under `if TYPE_CHECKING:`, never run)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.where: list[str] = []
        self.found: list[tuple[int, str, str]] = []

    def _add(self, node: ast.AST, names: list[str]) -> None:
        where = self.where[-1] if self.where else "top"
        self.found += [(node.lineno, name, where) for name in names]  # type: ignore[attr-defined]

    def visit_Import(self, node: ast.Import) -> None:
        self._add(node, [alias.name for alias in node.names])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.package.split(".")
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        self._add(node, [base, *(f"{base}.{alias.name}" for alias in node.names)])

    def _inside(self, where: str, node: ast.AST) -> None:
        self.where.append(where)
        self.generic_visit(node)
        self.where.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        outer = self.where[-1] if self.where else "top"
        self._inside("ready" if node.name == "ready" or outer == "ready" else "function", node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            self._inside("typing", node)
        else:
            self.generic_visit(node)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an import names (`gpus.models.GPU` → `gpus.models`), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def module_imports(modules: dict[str, Path]) -> Iterator[tuple[str, int, str, str]]:
    """(importer, line, imported project module, where) for every import between project modules."""
    for module, path in modules.items():
        visitor = _Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text()))
        for line, name, where in visitor.found:
            target = _resolve(name, modules)
            if target and target != module:
                yield module, line, target, where


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_import_cycle_among_project_modules():
    """Imports inside functions count; only an AppConfig.ready() (run once every module is
    loaded) and type-checking-only imports do not."""
    edges: dict[str, set[str]] = {}
    for module, _, target, where in module_imports(project_modules()):
        if where not in ("ready", "typing"):
            edges.setdefault(module, set()).add(target)
    assert import_cycles(edges) == []


def test_project_modules_are_imported_inside_a_function_only_by_ready():
    """An import inside a function to dodge a cycle means the code sits in the wrong place
    (docs/design.md). Optional third-party packages (python-ldap) may still be imported late."""
    modules = project_modules()
    hidden = {
        f"{modules[module].relative_to(ROOT).as_posix()}:{line} imports {target}"
        for module, line, target, where in module_imports(modules)
        if where == "function"
    }
    assert sorted(hidden) == []


def test_the_cycle_finder_sees_a_cycle_through_a_function_import():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    visitor = _Imports("portal.x", False)
    visitor.visit(
        ast.parse(
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from gpus import models\n"
            "def f():\n    from . import tasks\n"
            "class C:\n    def ready(self):\n        import jobs.signals\n"
        )
    )
    assert (3, "gpus.models", "typing") in visitor.found
    assert (5, "portal.tasks", "function") in visitor.found
    assert (8, "jobs.signals", "ready") in visitor.found


# --- (b) templates: a lower app's template never names a higher app's ----------------------------

TEMPLATES = ROOT / "templates"
TEMPLATE_TAG = re.compile(r"{%-?\s*(extends|include|load|import|from)\s+(.*?)\s*-?%}", re.S)


def template_app(name: str) -> str:
    """The app whose template this is, by its folder (jinja2/ holds a second engine's); the shared
    templates at the top (base.html, _pagination.html, registration/) are the lowest layer's."""
    parts = name.split("/")
    if parts[0] == "jinja2":
        parts = parts[1:]
    return parts[0] if len(parts) > 1 and parts[0] in RANK else "portal"


def tag_library_apps() -> dict[str, str]:
    """Tag library name → the app that defines it (its templatetags/ module)."""
    return {
        path.stem: app
        for app in RANK
        for path in (ROOT / app).glob("templatetags/*.py")
        if path.stem != "__init__"
    }


def template_references(source: str, libraries: dict[str, str]) -> Iterator[tuple[str, str]]:
    """(what, app named) for each template or tag library a template's source names."""
    for tag, args in TEMPLATE_TAG.findall(source):
        if tag == "load":
            words = args.split()
            names = words[words.index("from") + 1 :] if "from" in words else words
            yield from ((f"load {lib}", libraries[lib]) for lib in names if lib in libraries)
        else:
            quoted = re.match(r"""["']([^"']+)["']""", args)
            if quoted:
                yield f"{tag} {quoted[1]}", template_app(quoted[1])


def test_no_template_of_a_lower_app_names_a_higher_apps_templates_or_tags():
    libraries = tag_library_apps()
    wrong = []
    for path in sorted(TEMPLATES.rglob("*.html")):
        name = path.relative_to(TEMPLATES).as_posix()
        own = template_app(name)
        for what, app in template_references(path.read_text(), libraries):
            if RANK[app] > RANK[own]:
                wrong.append(f"templates/{name}: {what} ({app})")
    assert wrong == []


def test_the_template_check_sees_includes_extends_and_tag_libraries():
    libraries = {"quota_tags": "gpus", "slot_tags": "portal"}
    source = (
        '{% extends "jobs/base.html" %}{% load static quota_tags %}{% load slot_tags %}'
        "{% include 'gpus/_row.html' with r=r %}{% include \"_filters.html\" %}"
    )
    assert list(template_references(source, libraries)) == [
        ("extends jobs/base.html", "jobs"),
        ("load quota_tags", "gpus"),
        ("load slot_tags", "portal"),
        ("include gpus/_row.html", "gpus"),
        ("include _filters.html", "portal"),
    ]
    assert template_app("jinja2/gpus/_gpu_card.html") == "gpus"
    assert template_app("registration/login.html") == "portal"


# --- (c) migrations: a lower app's never depends on a higher app's ------------------------------


def migration_dependencies(path: Path, name: str = "dependencies") -> list[tuple[str, str]]:
    """The (app, migration) pairs in a migration's `dependencies` (swappable ones left out), or in
    its `replaces` (a squashed migration's)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return [
                (item.elts[0].value, item.elts[1].value)
                for item in node.value.elts  # type: ignore[attr-defined]
                if isinstance(item, ast.Tuple) and all(isinstance(e, ast.Constant) for e in item.elts)
            ]
    return []


def replaced_migrations() -> set[tuple[str, str]]:
    """The migrations a squashed one replaces: kept one release for databases that applied some
    of them, then deleted (docs/development.md, "Migrations")."""
    return {
        replaced
        for app in RANK
        for path in (ROOT / app / "migrations").glob("0*.py")
        for replaced in migration_dependencies(path, "replaces")
    }


def upward_migration_dependencies(*, replaced_too: bool = False) -> list[str]:
    replaced = set() if replaced_too else replaced_migrations()
    wrong = []
    for app in RANK:
        for path in sorted((ROOT / app / "migrations").glob("0*.py")):
            if (app, path.stem) in replaced:
                continue
            for other, migration in migration_dependencies(path):
                if RANK.get(other, -1) > RANK[app]:
                    wrong.append(f"{app}/migrations/{path.name} depends on {other}.{migration}")
    return wrong


def test_no_migration_of_a_lower_app_depends_on_a_higher_app():
    """Replaced migrations aside: gpus 0003 once depended on jobs 0001 (which depends on gpus
    0002); the squash of gpus 0003-0004 that replaces it does not, and is what a new database runs."""
    assert upward_migration_dependencies() == []


def test_only_a_replaced_migration_depends_on_a_higher_app():
    """The old exception stays in the history until the originals are deleted, and no other."""
    assert upward_migration_dependencies(replaced_too=True) == [
        "gpus/migrations/0003_gpuprocess_job.py depends on jobs.0001_initial"
    ]
    assert replaced_migrations() == {("gpus", "0003_gpuprocess_job"), ("gpus", "0004_gpuprocess_job_id")}
