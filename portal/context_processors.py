from django.conf import settings
from django.http import HttpRequest


def portal(request: HttpRequest) -> dict:
    return {"TIME_ZONE": settings.TIME_ZONE, "BOOKING_MAX_HOURS": settings.BOOKING_MAX_HOURS}
