"""{{ value|figure }}: a measured figure printed by the portal's one rule (portal/figures.py)."""

from __future__ import annotations

from django import template

from portal.figures import figure as _figure

register = template.Library()


@register.filter
def figure(value: float | int | None) -> str:
    """GPU-hours, GiB-hours, percentages: never "0.0" for a figure that is not zero."""
    return _figure(value)
