"""{% my_quotas %}: the viewer's quota in each of their teams, with their use now and this week.

portal's profile page shows it without portal importing gpus: the page is portal's (the
account, its token), the use is counted from bookings here.
"""

from __future__ import annotations

from typing import Any

from django import template
from django.conf import settings
from django.utils import timezone

from gpus.quotas import team_use
from portal.access import is_admin

register = template.Library()


@register.inclusion_tag("gpus/_my_quotas.html", takes_context=True)
def my_quotas(context: template.Context) -> dict[str, Any]:
    user = context["request"].user
    now = timezone.now()
    memberships = [
        (m, team_use(m.team, now).get(user.pk), m.is_leader or is_admin(user))
        for m in user.memberships.select_related("team").order_by("team__name")
    ]
    return {"memberships": memberships, "BOOKING_MAX_HOURS": settings.BOOKING_MAX_HOURS}
