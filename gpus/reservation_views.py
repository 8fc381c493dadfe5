"""Booking pages: the form, "My reservations", one booking, and its actions.

Every rule is in gpus/booking.py; these views only translate its errors into form errors
or messages. POST → redirect → GET throughout.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from gpus import booking
from gpus.filters import MyReservationFilter
from gpus.forms import CancelForm, ExtendForm, ReservationForm, local_input
from gpus.hooks import work_on_booking
from gpus.models import Reservation, Server
from gpus.quota_usage import member_quotas
from portal.access import can_manage_team
from portal.errors import Forbidden, ServiceError
from portal.filters import filter_list
from portal.http import redirect_back
from portal.models import AuditEntry
from portal.timefmt import format_time

PAST_PAGE_SIZE = 25


def _get_reservation_for_user(user, pk: int) -> Reservation:  # type: ignore[no-untyped-def]
    """The booking if the user may see it (own, their team's, or admin); else 404."""
    return get_object_or_404(
        Reservation.objects.restrict(user).select_related("owner", "team", "cancelled_by"), pk=pk
    )


@login_required
def reservation_new(request: HttpRequest) -> HttpResponse:
    server_name = request.GET.get("server") or None
    preset = request.GET.getlist("gpu")
    if request.method == "POST":
        form = ReservationForm(request.POST, user=request.user)
        if form.is_valid():
            try:
                reservation = booking.reservation_create(user=request.user, **form.service_kwargs())
            except ServiceError as error:
                form.add_service_error(error)
            else:
                messages.success(
                    request,
                    f"Booked {reservation.summary}, {format_time(reservation.start)} "
                    f"– {format_time(reservation.end)}.",
                )
                return redirect("reservation_detail", pk=reservation.pk)
    else:
        initial = {"gpus": preset, "server": server_name or ""}
        form = ReservationForm(user=request.user, server_name=server_name, initial=initial)
    # The page links to the server's timeline: only for a server there is (?server=1.5 has no URL).
    if server_name and not Server.objects.filter(name=server_name).exists():
        server_name = None
    return render(request, "gpus/reservation_form.html", {"form": form, "server_name": server_name})


@require_GET
@login_required
def my_reservations(request: HttpRequest) -> HttpResponse:
    """The user's quotas, then their bookings through one filter form: open ones (soonest first,
    all of them), and a page of the others (newest first)."""
    now = timezone.now()
    mine = Reservation.objects.filter(owner=request.user).select_related("team", "cancelled_by")
    mine = mine.prefetch_related("allocations__gpu__server")
    filter_form, shown = filter_list(request, MyReservationFilter, mine)
    open_ = shown.with_status("open", now)
    past = shown.exclude(pk__in=open_.values("pk")).order_by("-start", "-id")
    context = {
        "quotas": member_quotas(request.user, now),
        "filter_form": filter_form,
        "open": list(open_.order_by("start", "id")),
        "page": Paginator(past, PAST_PAGE_SIZE).get_page(request.GET.get("page")),
        "extend_form": ExtendForm(),
    }
    return render(request, "gpus/my_reservations.html", context)


@login_required
def reservation_detail(request: HttpRequest, pk: int) -> HttpResponse:
    reservation = _get_reservation_for_user(request.user, pk)
    return render(
        request, "gpus/reservation_detail.html", _detail_context(request, reservation, CancelForm())
    )


def _detail_context(request: HttpRequest, reservation: Reservation, cancel_form: CancelForm) -> dict:
    manager = can_manage_team(request.user, reservation.team_id)
    audit = AuditEntry.objects.filter(target=f"reservation {reservation.pk}") if manager else []
    return {
        "r": reservation,
        "allocations": reservation.allocations.select_related("gpu__server"),
        "is_owner": reservation.owner_id == request.user.pk,
        "can_manage": manager,
        "extend_form": ExtendForm(initial={"end": local_input(reservation.end)}),
        "cancel_form": cancel_form,
        "audit": audit,
    }


def _act(request: HttpRequest, pk: int, action, success: str) -> HttpResponse:  # type: ignore[no-untyped-def]
    """Run a booking action; refusals become messages (403 when it is not the user's to do)."""
    reservation = _get_reservation_for_user(request.user, pk)
    try:
        action(reservation)
    except Forbidden as error:
        raise PermissionDenied(error.message) from error
    except ServiceError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, success)
    return redirect_back(request, "reservation_detail", pk)


def _confirm_stopping(
    request: HttpRequest, pk: int, action: str, form: CancelForm | None = None
) -> HttpResponse | None:
    """A release or cancel that would stop jobs or sessions asks first, naming them; None: go on
    (nothing runs, or the person confirmed). A cancel of someone else's booking asks for its
    reason there too (`form`, with its refusal beside the field)."""
    if request.POST.get("confirm") == "1" and not (form and form.errors):
        return None
    reservation = _get_reservation_for_user(request.user, pk)
    if reservation.status != Reservation.Status.ACTIVE or not (work := work_on_booking(reservation.pk)):
        return None
    context = {"r": reservation, "work": work, "action": action, "post": request.POST, "form": form}
    return render(
        request, "gpus/reservation_confirm.html", context, status=400 if form and form.errors else 200
    )


def _cancel_reason(request: HttpRequest, pk: int) -> tuple[CancelForm | None, HttpResponse | None]:
    """The reason of a cancel of someone else's booking, checked before anything stops (the one
    rule: booking.cancel_reason_check); refused, the page that asked for it again, the refusal
    beside the field, nothing written. The form is None for the owner's own cancel (no reason)."""
    reservation = _get_reservation_for_user(request.user, pk)
    if reservation.owner_id == request.user.pk or not reservation.is_open:
        return None, None  # the service refuses an ended booking, and says why, as before
    form = CancelForm(request.POST)
    form.is_valid()
    form.errors.pop("reason", None)  # the rule below has its own words for the same checks
    try:
        booking.cancel_reason_check(
            user=request.user, reservation=reservation, reason=request.POST.get("reason", "")
        )
    except Forbidden as error:
        raise PermissionDenied(error.message) from error
    except ServiceError as error:
        form.add_service_error(error)
    if not form.errors:
        return form, None
    if asked := _confirm_stopping(request, pk, "cancel", form):
        return form, asked
    context = _detail_context(request, reservation, form)
    return form, render(request, "gpus/reservation_detail.html", context, status=400)


@require_POST
@login_required
def reservation_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    form, refused = _cancel_reason(request, pk)
    if refused:
        return refused
    if asked := _confirm_stopping(request, pk, "cancel", form):
        return asked
    reason = request.POST.get("reason", "")
    return _act(
        request,
        pk,
        lambda r: booking.reservation_cancel(user=request.user, reservation=r, reason=reason),
        "The booking is cancelled; its cards are free again.",
    )


@require_POST
@login_required
def reservation_release(request: HttpRequest, pk: int) -> HttpResponse:
    if asked := _confirm_stopping(request, pk, "release"):
        return asked
    return _act(
        request,
        pk,
        lambda r: booking.reservation_release(user=request.user, reservation=r),
        "Released: the cards are free for others from now.",
    )


@require_POST
@login_required
def reservation_extend(request: HttpRequest, pk: int) -> HttpResponse:
    form = ExtendForm(request.POST)
    if not form.is_valid():
        _get_reservation_for_user(request.user, pk)
        messages.error(request, f"New end: {form.errors['end'][0]} Use the date and time picker.")
        return redirect("reservation_detail", pk=pk)
    end = form.cleaned_data["end"]
    return _act(
        request,
        pk,
        lambda r: booking.reservation_extend(user=request.user, reservation=r, end=end),
        f"Extended until {format_time(end)}.",
    )
