"""{% notification_bell %}: the navigation bar's bell with the viewer's unread count.

Rendered with the page, so the count is there at once; htmx then polls the same partial
(portal.notification_views.notification_bell) to keep it current.
"""

from __future__ import annotations

from typing import Any

from django import template

from portal.notifications import unread_count

register = template.Library()


@register.inclusion_tag("portal/_bell.html", takes_context=True)
def notification_bell(context: template.Context) -> dict[str, Any]:
    return {"unread": unread_count(context["request"].user)}
