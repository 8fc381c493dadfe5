"""{% my_quotas %}: the viewer's quota in each of their teams, with their use now and this week.

portal's profile page shows it without portal importing gpus: the page is portal's (the
account, its token), the use is counted from bookings here.
"""

from __future__ import annotations

from typing import Any

from django import template
from django.conf import settings

from gpus.quotas import member_quotas

register = template.Library()


@register.inclusion_tag("gpus/_my_quotas.html", takes_context=True)
def my_quotas(context: template.Context) -> dict[str, Any]:
    memberships = member_quotas(context["request"].user)
    return {"memberships": memberships, "BOOKING_MAX_HOURS": settings.BOOKING_MAX_HOURS}
