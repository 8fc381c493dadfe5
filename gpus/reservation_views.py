"""Booking pages (being built)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse


@login_required
def my_reservations(request: HttpRequest) -> HttpResponse:
    return HttpResponse("being built")


@login_required
def reservation_new(request: HttpRequest) -> HttpResponse:
    return HttpResponse("being built")


@login_required
def reservation_detail(request: HttpRequest, pk: int) -> HttpResponse:
    return HttpResponse("being built")


@login_required
def reservation_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    return HttpResponse("being built")


@login_required
def reservation_release(request: HttpRequest, pk: int) -> HttpResponse:
    return HttpResponse("being built")


@login_required
def reservation_extend(request: HttpRequest, pk: int) -> HttpResponse:
    return HttpResponse("being built")
