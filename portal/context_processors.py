from django.conf import settings
from django.http import HttpRequest


def portal(request: HttpRequest) -> dict:
    """TIME_ZONE: the zone this request's times are in (portal.time_zones), and where it came from."""
    return {
        "TIME_ZONE": getattr(request, "time_zone", settings.TIME_ZONE),
        "TIME_ZONE_SOURCE": getattr(request, "time_zone_source", "portal"),
        "BOOKING_MAX_HOURS": settings.BOOKING_MAX_HOURS,
    }
