"""{% slot "name" key=value ... %}: what the apps above filled the slot with (portal/hooks.py)."""

from __future__ import annotations

from typing import Any

from django import template
from django.utils.safestring import SafeString, mark_safe

from portal.hooks import slot_fillings

register = template.Library()


@register.simple_tag(takes_context=True)
def slot(context: template.Context, name: str, **values: Any) -> SafeString:
    """Each filling's template rendered with the page's context, the tag's `values` (as
    `{% include ... with %}` would) and its own context function's answer."""
    parts = []
    for filling in slot_fillings(name):
        extra = {**values, **(filling.context(context) if filling.context else {})}
        with context.push(**extra):
            parts.append(context.template.engine.get_template(filling.template).render(context))
    return mark_safe("".join(parts))  # each part was rendered, and escaped, by its template
