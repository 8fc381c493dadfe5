"""Chat and webhook channels on the pages: a person's on their profile ("Chat and webhooks",
templates/portal/_channels.html) and /profile/channels/, a team's on /teams/<slug>/channels/
(its leaders and admins). The services are portal.channels; the API is portal/channel_api.py.
POST → redirect → GET; a refused form comes back with every error beside its field.
"""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import AbstractBaseUser
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from portal.access import team_for_user
from portal.channels import (
    EXAMPLES,
    channel_create,
    channel_delete,
    channel_for_user,
    channel_test,
    event_choices,
    url_readable,
)
from portal.errors import ServiceError
from portal.forms import ServiceErrorsMixin
from portal.models import NotificationChannel, Team


class ChannelForm(ServiceErrorsMixin, forms.Form):
    url = forms.CharField(
        label="Apprise URL",
        max_length=2000,
        widget=forms.TextInput(attrs={"autocomplete": "off", "spellcheck": "false"}),
        help_text=f"Your service's URL as apprise writes it, e.g. {EXAMPLES}. It is kept encrypted "
        "and shown masked.",
    )
    # No max_length here: the service checks it, beside the URL's check, so both show at once.
    label = forms.CharField(
        label="Label", required=False, help_text="e.g. #gpu-alerts; at most 100 characters."
    )
    events = forms.MultipleChoiceField(
        widget=forms.CheckboxSelectMultiple,
        required=False,
        label="Send",
        help_text="None ticked: every one.",
    )

    def __init__(self, *args: object, team: Team | None = None, **kwargs: object) -> None:
        # Its own ids: the profile page holds other forms (a `label` or `url` there must not clash).
        super().__init__(*args, auto_id="channel_%s", **kwargs)
        self.fields["events"].choices = event_choices(team=team is not None)


def channel_rows(channels: list[NotificationChannel]) -> list[tuple[NotificationChannel, bool, list[str]]]:
    """Each channel, whether its URL can still be read (by its signature: never decrypted here),
    and its events' labels."""
    labels = dict(event_choices(team=True)) | dict(event_choices(team=False))
    return [
        (c, url_readable(c.url_encrypted), [labels.get(e, e).split(":")[0] for e in c.events])
        for c in channels
    ]


def _page(request: HttpRequest, team: Team | None, form: ChannelForm | None = None) -> HttpResponse:
    channels = NotificationChannel.objects.filter(**({"team": team} if team else {"user": request.user}))
    context = {
        "team": team,
        "rows": channel_rows(list(channels)),
        "channel_form": form or ChannelForm(team=team),
        "action": reverse("team_channels", args=[team.slug]) if team else reverse("profile_channels"),
    }
    return render(request, "portal/team_channels.html", context)


def _add(request: HttpRequest, team: Team | None, back: str) -> HttpResponse:
    form = ChannelForm(request.POST, team=team)
    if form.is_valid():
        data = form.cleaned_data
        try:
            channel = channel_create(
                by=request.user, url=data["url"], events=data["events"], label=data["label"], team=team
            )
        except ServiceError as error:
            form.add_service_error(error)
        else:
            messages.success(request, f"Channel {channel} added; send it a test to see that it works.")
            return redirect(back)
    messages.error(request, "The channel was not added: correct the fields marked below.")
    return _page(request, team, form)


@login_required
def profile_channels(request: HttpRequest) -> HttpResponse:
    """The person's own channels; a POST adds one."""
    if request.method == "POST":
        return _add(request, None, reverse("profile") + "#channels")
    return _page(request, None)


@login_required
def team_channels(request: HttpRequest, slug: str) -> HttpResponse:
    """The team's channels (leaders and admins; members 403, outsiders 404); a POST adds one."""
    team = team_for_user(request.user, slug, manage=True)
    if request.method == "POST":
        return _add(request, team, reverse("team_channels", args=[team.slug]))
    return _page(request, team)


def _back(channel: NotificationChannel) -> str:
    if channel.team_id:
        return reverse("team_channels", args=[channel.team.slug])
    return reverse("profile") + "#channels"


def _get_channel_for_user(user: AbstractBaseUser, pk: int) -> NotificationChannel:
    return channel_for_user(user, pk)  # 404 for what the user does not manage


@require_POST
@login_required
def channel_test_send(request: HttpRequest, pk: int) -> HttpResponse:
    """Send a test now; the page says what the service answered."""
    channel = _get_channel_for_user(request.user, pk)
    try:
        ok, reason = channel_test(channel=channel, by=request.user)
    except ServiceError as error:  # tested too soon after the last test
        messages.error(request, error.message)
        return redirect(_back(channel))
    if ok:
        messages.success(request, f"Test sent to {channel}: check that it arrived.")
    else:
        messages.error(request, f"Test to {channel} failed: {reason}")
    return redirect(_back(channel))


@require_POST
@login_required
def channel_remove(request: HttpRequest, pk: int) -> HttpResponse:
    channel = _get_channel_for_user(request.user, pk)
    back = _back(channel)
    channel_delete(channel=channel)
    messages.success(request, f"Channel {channel} deleted: it gets nothing more.")
    return redirect(back)
