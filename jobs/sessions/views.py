"""The pages of interactive sessions (jobs.sessions.services): "Open JupyterLab" on a booking, the
session's page (starting… then on to the lab, which is served from LAB_ORIGIN: jobs.sessions.lab_proxy),
the ticket that carries the owner's sign-in there (jobs.sessions.lab_handoff), and its End button.
Visible as jobs are (owner, the booking's team's leaders, admins: 404 for the rest); only the
owner opens a lab."""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import urlencode
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST

from jobs.models import InteractiveSession, lab_path
from jobs.sessions.lab_handoff import lab_auth_path, lab_for_owner, lab_next, lab_ticket_issue
from jobs.sessions.services import active_lab, session_end_request, session_start
from portal.access import can_manage
from portal.errors import Forbidden, ServiceError
from portal.http import redirect_back


def get_session_for_user(user, pk: int) -> InteractiveSession:  # type: ignore[no-untyped-def]
    session = InteractiveSession.objects.restrict(user).select_related("reservation", "server", "owner")
    found = session.filter(pk=pk).first()
    if found is None:
        raise Http404("No such session of yours.")
    return found


@require_POST
@login_required
def session_new(request: HttpRequest) -> HttpResponse:
    """Open JupyterLab on the booking given (the booking page's and the dashboard's button)."""
    raw = request.POST.get("reservation", "")
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
        messages.error(request, "Choose the booking to open JupyterLab on (reservation: a booking's number).")
        return redirect_back(request, "my_reservations")
    try:
        session, _ = session_start(
            user=request.user,
            reservation=int(raw),
            kind=InteractiveSession.Kind.JUPYTERLAB,
            image=request.POST.get("image", "")[:64] or None,
        )
    except Forbidden as error:
        messages.error(request, error.message)
        return redirect_back(request, "my_reservations")
    except ServiceError as error:
        if (open_lab := active_lab(int(raw))) is not None and open_lab.owner_id == request.user.pk:
            return redirect(f"{reverse('session_detail', args=[open_lab.pk])}?go=1")  # open the one there is
        messages.error(request, error.message)
        return redirect_back(request, "reservation_detail", int(raw))
    return redirect(f"{reverse('session_detail', args=[session.pk])}?go=1")


@require_GET
@login_required
def session_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """The session: starting (the page polls its status), running (on to the lab), or ended."""
    session = get_session_for_user(request.user, pk)
    context = {
        "s": session,
        "is_owner": session.owner_id == request.user.pk,
        "can_end": session.is_active and can_manage(request.user, session),
        "lab_url": lab_path(session.pk) if session.kind == InteractiveSession.Kind.JUPYTERLAB else "",
    }
    going = request.GET.get("go") == "1" and context["is_owner"] and context["lab_url"]
    if going and session.status == InteractiveSession.Status.RUNNING:
        if request.GET.get("part") == "status":  # htmx's poll: it follows this to the lab
            response = HttpResponse(status=204)
            response["HX-Redirect"] = context["lab_url"]
            return response
        return redirect(context["lab_url"])
    if request.GET.get("part") == "status":
        return render(request, "jobs/_session_status.html", context)
    return render(request, "jobs/session_detail.html", context)


@require_GET
@never_cache
@login_required
def lab_ticket(request: HttpRequest, pk: int) -> HttpResponse:
    """Step 3 of the hand-off (jobs.sessions.lab_handoff): a ticket into the signed-in owner's running lab,
    for the browser whose state the labs' origin sent here, and on to LAB_ORIGIN to redeem it.
    Anyone else, or a lab not running: 404. Without a state (a link made by hand): the lab's portal
    path, which starts the hand-off from the beginning."""
    if lab_for_owner(request.user.pk, pk) is None:
        raise Http404("No such lab of yours, or it is not running.")
    state = request.GET.get("state", "")
    if not state:
        return redirect(lab_path(pk))
    key = request.session.session_key or ""
    ticket = lab_ticket_issue(user=request.user, pk=pk, portal_session_key=key, state=state)
    if ticket is None:  # a state not made by the labs' origin, or the lab ended meanwhile
        raise Http404("No such lab of yours, or it is not running.")
    query = urlencode({"ticket": ticket, "next": lab_next(pk, request.GET.get("next"))})
    return redirect(f"{settings.LAB_ORIGIN}{lab_auth_path(pk)}?{query}")


@require_POST
@login_required
def session_end(request: HttpRequest, pk: int) -> HttpResponse:
    session = get_session_for_user(request.user, pk)
    if not can_manage(request.user, session):
        raise Http404("No such session of yours.")
    session_end_request(session=session, by=request.user)
    messages.success(request, f"Session {session.pk} ends now: its kernels are shut down.")
    return redirect("session_detail", pk=pk)
