"""{% profile_channels %}: the profile's "Chat and webhooks" section (portal/channel_views.py)."""

from __future__ import annotations

from typing import Any

from django import template
from django.urls import reverse

from portal.channel_views import ChannelForm, channel_rows
from portal.models import NotificationChannel

register = template.Library()


@register.inclusion_tag("portal/_channels.html", takes_context=True)
def profile_channels(context: template.Context) -> dict[str, Any]:
    """The viewer's own channels and the form to add one, which posts to /profile/channels/."""
    request = context["request"]
    channels = list(NotificationChannel.objects.filter(user=request.user))
    return {
        "request": request,
        "csrf_token": context.get("csrf_token"),
        "team": None,
        "rows": channel_rows(channels),
        "channel_form": ChannelForm(),
        "action": reverse("profile_channels"),
    }
