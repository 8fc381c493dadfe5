"""The check's result: one row per check, printed as a table and written to gpu-check-report.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["pass", "fail", "skip"]
SKIP_NOTE = "skip: not proved on this machine (a skip is not a pass)"


@dataclass
class Row:
    name: str
    expected: str
    seen: str
    status: Status
    seconds: float = 0.0


@dataclass
class Report:
    machine: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    started: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return any(row.status == "fail" for row in self.rows)

    def as_json(self) -> dict[str, Any]:
        counts = {
            status: sum(row.status == status for row in self.rows) for status in ("pass", "fail", "skip")
        }
        return {
            "started": self.started,
            "seconds": round(self.seconds, 1),
            "machine": self.machine,
            "result": "fail" if self.failed else "pass",
            "counts": counts,
            "checks": [asdict(row) for row in self.rows],
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_json(), indent=2) + "\n")


def print_table(report: Report) -> None:
    """rich's table where rich is installed (it is in requirements.txt), else plain lines."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        _print_plain(report)
        return
    table = Table(title=f"gpu-check on {report.machine.get('hostname', '?')}", show_lines=True)
    for column in ("check", "expected", "seen", "result", "s"):
        table.add_column(column, overflow="fold")
    style = {"pass": "green", "fail": "bold red", "skip": "yellow"}
    for row in report.rows:
        table.add_row(
            row.name, row.expected, row.seen, f"[{style[row.status]}]{row.status}[/]", f"{row.seconds:.1f}"
        )
    console = Console(width=max(140, Console().width))
    console.print(table)
    console.print(_summary(report))


def _print_plain(report: Report) -> None:
    for row in report.rows:
        print(f"[{row.status.upper()}] {row.name} ({row.seconds:.1f} s)")
        print(f"    expected: {row.expected}")
        print(f"    seen:     {row.seen}")
    print(_summary(report))


def _summary(report: Report) -> str:
    counts = report.as_json()["counts"]
    line = f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"
    line += f" in {report.seconds:.0f} s"
    return line + (f" ({SKIP_NOTE})" if counts["skip"] else "")
