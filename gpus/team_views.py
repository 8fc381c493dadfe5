"""The team page: its quota and members' quotas with their use, the auto-release of its idle
bookings, its bookings and audit log (filtered by the API's own AuditEntryFilter, a page at a time).

These are booking-domain pages on portal's teams: who may see them is decided by
`portal.access.team_for_user` (the API uses it too); the quota rules are in gpus/quotas.py.
POST → redirect → GET; a refused form is shown again with the message beside its field, and
nothing was written. The auto-release checkbox posts to the page itself (leaders and admins, who
alone see the page). The team list, the profile and the API token stay in portal/views.py.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from functools import partial

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from gpus.calendar_views import calendar_panel
from gpus.idle import team_auto_release_set, team_lend_idle_set
from gpus.models import Reservation
from gpus.quota_usage import NO_USE, over_limits, team_use, team_use_total
from gpus.quotas import quota_member_set, quota_team_set
from gpus.team_forms import AutoReleaseForm, LendIdleForm, MemberQuotaForm, QuotaForm, TeamQuotaForm
from portal.access import is_admin, leads_team, team_for_user
from portal.errors import ServiceError
from portal.filters import AuditEntryFilter, filter_list
from portal.models import AuditEntry, Membership, Team

AUDIT_PAGE_SIZE = 50
RECENT_BOOKINGS_SHOWN = 50


def _team_page(
    request: HttpRequest,
    team: Team,
    *,
    team_form: TeamQuotaForm | None = None,
    member_forms: dict[int, MemberQuotaForm] | None = None,
) -> HttpResponse:
    """The leader's page; a refused form (bound, with its errors) replaces the blank one."""
    now = timezone.now()
    use = team_use(team, now)
    member_forms = member_forms or {}
    members = [
        (m, use.get(m.user_id), member_forms.get(m.pk) or MemberQuotaForm.for_membership(m))
        for m in team.memberships.select_related("user").order_by("role", "user__username")
    ]
    context = {
        "team": team,
        "team_total": team_use_total(use),
        "team_form": (team_form or TeamQuotaForm.for_team(team)) if is_admin(request.user) else None,
        "members": members,
        "auto_release_form": AutoReleaseForm.for_team(team),
        "lend_idle_form": LendIdleForm.for_team(team),
        # Its leaders' feed of the team's bookings (admins who do not lead it have servers' feeds).
        "calendar": calendar_panel(request, team=team) if leads_team(request.user, team) else None,
        **_team_bookings(team, now),
        **_team_audit(request, team),
    }
    return render(request, "gpus/team_detail.html", context)


def _team_audit(request: HttpRequest, team: Team) -> dict[str, object]:
    """The audit log through its filter form (the API's AuditEntryFilter), a page at a time."""
    entries = AuditEntry.objects.filter(team=team).select_related("actor").order_by("-at", "-id")
    audit_form, entries = filter_list(request, AuditEntryFilter, entries)
    page = Paginator(entries, AUDIT_PAGE_SIZE).get_page(request.GET.get("page"))
    return {"audit_form": audit_form, "audit_page": page}


def _team_bookings(team: Team, now: datetime) -> dict[str, list[Reservation]]:
    bookings = Reservation.objects.filter(team=team).select_related("owner", "cancelled_by")
    split = bookings.prefetch_related("allocations__gpu__server").split_open(
        now, past_limit=RECENT_BOOKINGS_SHOWN
    )
    return {"open_bookings": split["open"], "recent_bookings": split["past"]}


@require_http_methods(["GET", "POST"])
@login_required
def team_detail(request: HttpRequest, slug: str) -> HttpResponse:
    """The page; a POST is one of its switches for idle bookings."""
    team = team_for_user(request.user, slug, manage=True)
    if request.method == "POST":  # one of the two switches; an old form without `what` is auto-release's
        which = request.POST.get("what") or "release"
        if which not in _SWITCHES:  # a typo must not turn auto-release off
            messages.error(
                request, f"what={which[:40]!r} names no switch: give release or lend. Nothing changed."
            )
            return redirect(f"{reverse('team_detail', args=[team.slug])}#idle")
        return _switch(request, team, which)
    return _team_page(request, team)


# The team's two switches for idle bookings: the form's field, the service that sets it (audited;
# nothing written when nothing changes), and how the answer names it.
_SWITCHES = {
    "release": (AutoReleaseForm, "auto_release_idle", team_auto_release_set, "Auto-release of idle bookings"),
    "lend": (LendIdleForm, "lend_idle", team_lend_idle_set, "Lending idle bookings to the queue"),
}


def _switch(request: HttpRequest, team: Team, which: str) -> HttpResponse:
    form_class, field, service, what = _SWITCHES[which]
    form = form_class(request.POST)
    on = form.is_valid() and form.cleaned_data[field]  # a checkbox: unticked is off
    changed = getattr(team, field) != on
    service(actor=request.user, team=team, on=on)
    state = "on" if on else "off"
    if changed:
        messages.success(request, f"{what} is {state}; the change is in the audit log.")
    else:
        messages.info(request, f"{what} was already {state}: nothing changed.")
    return redirect(f"{reverse('team_detail', args=[team.slug])}#idle")


def _save(
    request: HttpRequest, form: QuotaForm, target: Team | Membership, save: Callable[..., object], what: str
) -> bool:
    """Validate, call the service, report the outcome; False (with the form's errors) if refused."""
    if not form.is_valid():
        messages.error(request, f"{what} was not saved: correct the fields marked below.")
        return False
    limits = form.limits()
    changed = any(getattr(target, name) != value for name, value in limits.items())
    try:
        save(**limits)
    except ServiceError as error:
        form.add_service_error(error)
        messages.error(request, f"{what} was not saved: correct the fields marked below.")
        return False
    if changed:
        messages.success(request, f"{what} saved; the change is in the audit log.")
    else:
        messages.info(request, f"{what}: nothing changed.")
    return True


def _flag_over(request: HttpRequest, who: str, over: list[str]) -> None:
    """A limit saved below what is in use: said, not silent (issue 23)."""
    if over:
        messages.warning(
            request,
            f"{who} {'; '.join(over)}: nothing held is taken away, but new bookings are refused "
            "until the use is under the limit.",
        )


@require_POST
@login_required
def team_quota(request: HttpRequest, slug: str) -> HttpResponse:
    team = team_for_user(request.user, slug, manage=False)
    if not is_admin(request.user):
        raise PermissionDenied("Only admins set team quotas; ask one.")
    form = TeamQuotaForm.for_team(team, request.POST)
    save = partial(quota_team_set, actor=request.user, team=team)
    if _save(request, form, team, save, f"The quota of {team}"):
        team.refresh_from_db()
        _flag_over(request, f"{team} already uses", over_limits(team, team_use_total(team_use(team))))
        return redirect("team_detail", slug=team.slug)
    return _team_page(request, team, team_form=form)


@require_POST
@login_required
def member_quota(request: HttpRequest, slug: str, username: str) -> HttpResponse:
    team = team_for_user(request.user, slug, manage=True)
    membership = get_object_or_404(
        Membership.objects.select_related("team", "user"), team=team, user__username=username
    )
    form = MemberQuotaForm.for_membership(membership, request.POST)
    save = partial(quota_member_set, actor=request.user, membership=membership)
    if _save(request, form, membership, save, f"{membership.user}'s quota in {team}"):
        membership.refresh_from_db()
        use = team_use(team).get(membership.user_id, NO_USE)
        _flag_over(request, f"{membership.user} already uses", over_limits(membership, use))
        return redirect(f"{reverse('team_detail', args=[team.slug])}#member-{membership.pk}")
    return _team_page(request, team, member_forms={membership.pk: form})
