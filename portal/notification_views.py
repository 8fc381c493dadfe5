"""The inbox (/notifications/), marking read, and the bell's partial in the navigation bar.

Everyone sees only their own notifications: another's id is 404. Writes go through
portal.notifications; POST → redirect → GET.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET, require_POST

from portal.filters import filter_list
from portal.http import redirect_back
from portal.models import Notification
from portal.notifications import NotificationFilter, notifications_mark_read, unread_count

PAGE_SIZE = 25
# htmx stops polling on this status: the bell of a page left open after logging out goes away
# instead of asking every 10 s (or swapping the login page into the navigation bar).
HTMX_STOP_POLLING = 286


def _get_notification_for_user(user, pk: int) -> Notification:  # type: ignore[no-untyped-def]
    return get_object_or_404(Notification, pk=pk, user=user)


@require_GET
@login_required
def notifications(request: HttpRequest) -> HttpResponse:
    """The user's notifications, newest first, through the inbox's filter form."""
    filter_form, shown = filter_list(request, NotificationFilter, request.user.notifications.all())
    page = Paginator(shown.order_by("-created_at", "-id"), PAGE_SIZE).get_page(request.GET.get("page"))
    context = {"filter_form": filter_form, "page": page, "unread": unread_count(request.user)}
    return render(request, "portal/notifications.html", context)


@require_POST
@login_required
def notification_read(request: HttpRequest, pk: int) -> HttpResponse:
    notification = _get_notification_for_user(request.user, pk)
    notifications_mark_read(user=request.user, ids=[notification.pk])
    return redirect_back(request, "notifications")


@require_POST
@login_required
def notifications_read_all(request: HttpRequest) -> HttpResponse:
    marked = notifications_mark_read(user=request.user)
    messages.success(request, f"Marked {marked} notification{'' if marked == 1 else 's'} read.")
    return redirect_back(request, "notifications")


@require_GET
def notification_bell(request: HttpRequest) -> HttpResponse:
    """The bell alone, for htmx to poll."""
    if not request.user.is_authenticated:
        return HttpResponse(status=HTMX_STOP_POLLING)
    return render(request, "portal/_bell.html", {"unread": unread_count(request.user)})
