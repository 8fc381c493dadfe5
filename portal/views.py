"""Profile and teams pages.

What these pages show is what portal owns: the account, its API tokens, the teams. Quota use
is counted from bookings, so it is gpus' to show: gpus fills the profile's "Teams and quotas"
slot (portal/hooks.py, gpus/slots.py), and the team page with its quota forms is
gpus/team_views.py. The profile also holds the mail preferences (portal.notifications);
the inbox is portal/notification_views.py. POST → redirect → GET.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import PermissionDenied
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.html import format_html
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods, require_POST

from portal.access import VIEW, is_admin, roles_of
from portal.errors import ServiceError
from portal.forms import JobNotifyForm, MailPreferenceForm, TeamCreateForm, TimeZoneForm
from portal.http import redirect_back
from portal.models import ApiToken, Membership, Profile, Team
from portal.notifications import job_notify_of, job_notify_set, mail_kinds_wanted, mail_preference_set
from portal.services import api_token_create, api_token_revoke
from portal.teams import team_create
from portal.time_zones import profile_time_zone_set, time_zone_offer_answered
from portal.tokens import ApiTokenForm, api_token_expiry


@never_cache  # it shows a new API token's key once: never from a cache
@login_required
def profile(request: HttpRequest) -> HttpResponse:
    """The account, its API tokens, and (POST) its mail preferences."""
    if request.method == "POST":
        mail_form = MailPreferenceForm(request.POST)
        if mail_form.is_valid():
            mail_preference_set(user=request.user, kinds=mail_form.cleaned_data["kinds"])
            messages.success(request, "Mail preferences saved.")
            return redirect(reverse("profile") + "#mail")
        return _profile_page(request, mail_form=mail_form)
    return _profile_page(request)


def _profile_page(
    request: HttpRequest,
    *,
    mail_form: MailPreferenceForm | None = None,
    token_form: ApiTokenForm | None = None,
    zone_form: TimeZoneForm | None = None,
    jobs_form: JobNotifyForm | None = None,
) -> HttpResponse:
    if mail_form is None:
        mail_form = MailPreferenceForm(initial={"kinds": mail_kinds_wanted(request.user)})
    profile = Profile.objects.filter(user=request.user).first()
    context = {
        "zone_form": zone_form or TimeZoneForm(initial={"time_zone": profile.time_zone if profile else ""}),
        "tokens": ApiToken.objects.filter(user=request.user),
        "token_form": token_form or ApiTokenForm(),
        "mail_form": mail_form,
        "mail_every": settings.NOTIFY_MAIL_EVERY_MINUTES,
        "jobs_form": jobs_form or JobNotifyForm(initial={"events": job_notify_of(request.user)}),
        "job_min_minutes": settings.JOB_END_NOTIFY_MIN_MINUTES,
    }
    return render(request, "portal/profile.html", context)


@require_POST
@login_required
def profile_time_zone(request: HttpRequest) -> HttpResponse:
    """Where the person's times are shown and read; refused beside the field, nothing written."""
    if "later" in request.POST:  # the offer after sign-in (base.html): not now, nothing saved
        response = redirect_back(request, "dashboard")
        time_zone_offer_answered(request, response)
        return response
    form = TimeZoneForm(request.POST)
    if form.is_valid():
        try:
            zone = profile_time_zone_set(
                user=request.user, time_zone=form.cleaned_data["time_zone"], request=request
            )
        except ServiceError as error:
            form.add_service_error(error)
        else:
            messages.success(request, f"Times are now shown in {zone or 'your browser’s time zone'}.")
            response = (
                redirect_back(request, "profile")
                if request.POST.get("next")
                else redirect(reverse("profile") + "#time-zone")
            )
            time_zone_offer_answered(request, response)
            return response
    return _profile_page(request, zone_form=form)


@require_POST
@login_required
def profile_job_notify(request: HttpRequest) -> HttpResponse:
    """What the person is told of their jobs (portal.notifications.job_notify_set)."""
    form = JobNotifyForm(request.POST)
    if form.is_valid():
        job_notify_set(user=request.user, events=form.cleaned_data["events"])
        messages.success(request, "Job notices saved.")
        return redirect(reverse("profile") + "#job-notices")
    return _profile_page(request, jobs_form=form)


@require_POST
@login_required
def token_create(request: HttpRequest) -> HttpResponse:
    """A new API token. Its key is shown once, in the message after the redirect: the messages
    cookie carries it to the owner's browser, so it never touches the database."""
    form = ApiTokenForm(request.POST)
    if form.is_valid():
        try:
            token, key = api_token_create(
                user=request.user,
                name=form.cleaned_data["name"],
                expires_at=api_token_expiry(form.cleaned_data["expires_in_days"]),
            )
        except ServiceError as error:
            form.add_service_error(error)
        else:
            messages.success(
                request,
                format_html(
                    "API token {} created. Copy it now: it is not shown again. "
                    '<code class="api-token-key">{}</code>',
                    token,
                    key,
                ),
                extra_tags="api-token",
            )
            return redirect(reverse("profile") + "#tokens")
    messages.error(request, "The token was not created: correct the fields marked below.")
    return _profile_page(request, token_form=form)


@require_POST
@login_required
def token_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    token = _get_token_for_user(request.user, pk)
    if api_token_revoke(token=token, by=request.user):
        messages.success(request, f"API token {token} revoked: it no longer works.")
    else:
        messages.info(request, f"API token {token} was revoked already.")
    return redirect(reverse("profile") + "#tokens")


def _get_token_for_user(user: AbstractBaseUser, pk: int) -> ApiToken:
    """One of the user's own tokens; anyone else's is a 404 (admins revoke in the admin)."""
    return get_object_or_404(ApiToken, pk=pk, user=user)


@require_http_methods(["GET", "POST"])
@login_required
def teams(request: HttpRequest) -> HttpResponse:
    """The teams the user sees; admins also create one here (POST: portal.teams.team_create)."""
    admin = is_admin(request.user)
    create_form = TeamCreateForm() if admin else None
    if request.method == "POST":
        if not admin:
            raise PermissionDenied("Only admins create teams; ask one.")
        create_form = TeamCreateForm(request.POST)
        if create_form.is_valid():
            try:
                team = team_create(actor=request.user, **create_form.cleaned_data)
            except ServiceError as error:
                create_form.add_service_error(error)
            else:
                messages.success(
                    request, f"Team {team} created; it is in its audit log. Set its quota below."
                )
                return redirect("team_detail", slug=team.slug)
    roles = roles_of(request.user)
    visible = Team.objects.restrict(request.user, VIEW)
    rows = [
        (team, roles.get(team.pk), admin or roles.get(team.pk) == Membership.Role.LEADER)
        for team in visible.annotate(member_count=Count("memberships")).order_by("name")
    ]
    return render(request, "portal/teams.html", {"rows": rows, "create_form": create_form})
