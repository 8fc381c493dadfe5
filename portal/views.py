"""Profile and teams pages.

What these pages show is what portal owns: the account, its API token, the teams. Quota use
is counted from bookings, so it is gpus' to show: the profile's "Teams and quotas" section is
gpus' `{% my_quotas %}` tag (gpus/templatetags/quota_tags.py), and the team page with its quota
forms is gpus/team_views.py. POST → redirect → GET.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST
from rest_framework.authtoken.models import Token

from portal.access import is_admin, roles_of
from portal.models import Membership, Team
from portal.services import api_token_regenerate


@login_required
def profile(request: HttpRequest) -> HttpResponse:
    token = Token.objects.filter(user=request.user).first()
    return render(request, "portal/profile.html", {"token": token})


@require_POST
@login_required
def regenerate_token(request: HttpRequest) -> HttpResponse:
    api_token_regenerate(user=request.user)
    messages.success(request, "A new API token was generated; the old one no longer works.")
    return redirect("profile")


@login_required
def teams(request: HttpRequest) -> HttpResponse:
    admin = is_admin(request.user)
    roles = roles_of(request.user)
    visible = Team.objects.all() if admin else Team.objects.filter(pk__in=roles)
    rows = [
        (team, roles.get(team.pk), admin or roles.get(team.pk) == Membership.Role.LEADER)
        for team in visible.annotate(member_count=Count("memberships")).order_by("name")
    ]
    return render(request, "portal/teams.html", {"rows": rows})
