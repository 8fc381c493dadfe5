from django.conf import settings
from django.http import HttpRequest


def portal(request: HttpRequest) -> dict:
    """TIME_ZONE: the zone this request's times are in (portal.time_zones), and where it came from."""
    return {
        "TIME_ZONE": getattr(request, "time_zone", settings.TIME_ZONE),
        "TIME_ZONE_SOURCE": getattr(request, "time_zone_source", "portal"),
        # The browser's zone, offered after a sign-in while none is chosen (base.html); else None.
        "TIME_ZONE_OFFER": getattr(request, "time_zone_offer", None),
        "PORTAL_TIME_ZONE": settings.TIME_ZONE,
        "BOOKING_MAX_HOURS": settings.BOOKING_MAX_HOURS,
        # The change count as the request began (portal.changes.ChangesSeenMiddleware); None: unknown.
        "CHANGES_SEEN": getattr(request, "changes_seen", None),
    }
