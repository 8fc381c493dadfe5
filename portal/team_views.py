"""A team's members page (admins): add someone as member or leader, change a role, take someone
out. The rules and the audit log are portal/teams.py's; the team's quotas and shares are on its
own page (gpus/team_views.py), the list and "create a team" on /teams/ (portal/views.py).

Outsiders get 404 (they never learn the team exists), its members and leaders 403. POST → redirect
→ GET; a refused add is shown again with the message beside its field, and nothing was written.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from portal.access import is_admin, team_for_user
from portal.errors import ServiceError
from portal.forms import MemberAddForm
from portal.models import Membership, Team
from portal.teams import directory_managed, team_member_add, team_member_remove, team_member_role_set

DIRECTORY_NOTE = (
    "The lab's directory sets this team's members at each sign-in (IDENTITY_GROUP_TEAMS): a change "
    "made here lasts until the person's next sign-in. Change their groups in the directory for good."
)


def _team_for_admin(request: HttpRequest, slug: str) -> Team:
    team = team_for_user(request.user, slug, manage=False)  # 404 for outsiders
    if not is_admin(request.user):
        raise PermissionDenied("Only admins change a team's members; ask one.")
    return team


def _membership(team: Team, username: str) -> Membership:
    return get_object_or_404(
        Membership.objects.select_related("team", "user"), team=team, user__username=username
    )


def _page(request: HttpRequest, team: Team, form: MemberAddForm | None = None) -> HttpResponse:
    members = team.memberships.select_related("user").order_by("role", "user__username")
    context = {
        "team": team,
        "members": members,
        "form": form or MemberAddForm(),
        "directory_note": DIRECTORY_NOTE if directory_managed(team) else "",
        "roles": Membership.Role.choices,
    }
    return render(request, "portal/team_members.html", context)


@require_http_methods(["GET", "POST"])
@login_required
def team_members(request: HttpRequest, slug: str) -> HttpResponse:
    """The members and their roles; a POST adds someone."""
    team = _team_for_admin(request, slug)
    if request.method == "GET":
        return _page(request, team)
    form = MemberAddForm(request.POST)
    if form.is_valid():
        try:
            membership = team_member_add(actor=request.user, team=team, **form.cleaned_data)
        except ServiceError as error:
            form.add_service_error(error)
        else:
            role = membership.get_role_display().lower()
            messages.success(request, f"{membership.user} is now {role} of {team}; it is in the audit log.")
            return redirect("team_members", slug=team.slug)
    return _page(request, team, form)


@require_POST
@login_required
def team_member_role(request: HttpRequest, slug: str, username: str) -> HttpResponse:
    team = _team_for_admin(request, slug)
    membership = _membership(team, username)
    try:
        changed = team_member_role_set(
            actor=request.user, membership=membership, role=request.POST.get("role", "")
        )
    except ServiceError as error:
        messages.error(request, f"{username}'s role was not changed: {error.message}")
    else:
        role = membership.get_role_display().lower()
        if changed:
            messages.success(request, f"{username} is now {role} of {team}; it is in the audit log.")
        else:
            messages.info(request, f"{username} was {role} already: nothing changed.")
    return redirect("team_members", slug=team.slug)


@require_POST
@login_required
def team_member_remove_view(request: HttpRequest, slug: str, username: str) -> HttpResponse:
    team = _team_for_admin(request, slug)
    membership = _membership(team, username)
    if not team_member_remove(actor=request.user, membership=membership):
        messages.info(request, f"{username} was no longer in {team} (removed just now): nothing changed.")
        return redirect("team_members", slug=team.slug)
    left = (
        "" if team.memberships.filter(role=Membership.Role.LEADER).exists() else f" {team} has no leader now."
    )
    messages.success(
        request,
        f"{username} is no longer in {team}: their queued jobs of {team} that had not started are "
        "cancelled (they and the leaders are told); their bookings and the jobs running or waiting on "
        f"them stay, and new bookings for {team} are refused them. It is in the audit log.{left}",
    )
    return redirect("team_members", slug=team.slug)
