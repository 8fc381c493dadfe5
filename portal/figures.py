"""How a measured figure is printed for people (GPU-hours, GiB-hours, percentages): one rule for
every page, so no page shows a figure that is not zero as "0.0" (issue 41: "0.0 booked" beside a
CSV's 0.033).

- zero is "0"; a figure below 0.001 (the CSV's last decimal) is "< 0.001";
- below 1: two significant figures (0.033, 0.5);
- below 100: one decimal, a trailing ".0" dropped (46.8, 12);
- from 100: whole, with thousands separated (1,235).

Templates use it as `{% load figure_tags %}{{ value|figure }}`; messages call `figure` itself.
"""

from __future__ import annotations

SMALLEST = 0.001


def na(value: object, suffix: str = "") -> str:
    """A metric the driver does not report (None) reads "n/a": the jinja2 cards' filter (a filter,
    not a macro, for speed) and the selectors' text. Here, not in portal/jinja2.py: the selectors
    load at every process's start, and jinja2 with them (19 modules, some 40-50 ms of CPU)."""
    return "n/a" if value is None else f"{value}{suffix}"


def figure(value: float | int | None) -> str:
    """`value` printed by the rule above; None (nothing measured) is "–"."""
    if value is None:
        return "–"
    number = float(value)
    size = abs(number)
    if size == 0:
        return "0"
    if size < SMALLEST:
        return f"< {SMALLEST:g}" if number > 0 else f"> -{SMALLEST:g}"
    if size < 1:
        return f"{number:.2g}"
    if round(size, 1) < 100:
        text = f"{number:.1f}"
        return text.removesuffix(".0")
    return f"{number:,.0f}"
