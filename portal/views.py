from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST
from rest_framework.authtoken.models import Token

from portal.services import api_token_regenerate


@login_required
def profile(request: HttpRequest) -> HttpResponse:
    token = Token.objects.filter(user=request.user).first()
    memberships = request.user.memberships.select_related("team")
    return render(request, "portal/profile.html", {"token": token, "memberships": memberships})


@require_POST
@login_required
def regenerate_token(request: HttpRequest) -> HttpResponse:
    api_token_regenerate(user=request.user)
    messages.success(request, "A new API token was generated; the old one no longer works.")
    return redirect("profile")
