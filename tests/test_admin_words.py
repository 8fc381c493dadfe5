"""/admin/ speaks the portal's words (issue 41, item 10): the labels of the portal's own pages, and
24-hour times."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.urls import reverse
from django.utils import timezone

from gpus.booking import reservation_create
from gpus.team_forms import MemberQuotaForm, TeamQuotaForm
from portal.models import AuditEntry

LABELS = ("Cards at once", "GiB at once", "GPU-hours per week")


def test_the_team_list_and_form_use_the_portals_labels(client, team, bob, admin_user):
    client.force_login(admin_user)
    listing = client.get(reverse("admin:portal_team_changelist")).content.decode()
    for label in LABELS:
        assert f">{label}<" in listing, label
    assert "Max cards" not in listing and "Gpu hours per week" not in listing

    form = client.get(reverse("admin:portal_team_change", args=[team.pk])).content.decode()
    for label in (*LABELS, "Longest booking (hours)", "Fair-share shares", "Lend idle bookings to the queue"):
        assert label in form, label
    assert "Max booking hours" not in form


def test_the_team_pages_forms_take_the_same_labels(team, bob):
    team_form, member_form = TeamQuotaForm(), MemberQuotaForm()
    assert [team_form[f].label for f in ("max_cards", "max_gb", "gpu_hours_per_week")] == list(LABELS)
    assert member_form["max_booking_hours"].label == "Longest booking (hours)"


def test_admin_lists_show_24_hour_times(client, alice, box, admin_user):
    afternoon = timezone.make_aware(datetime(2030, 3, 4, 15, 30))
    entry = AuditEntry.objects.create(
        actor=alice, action=AuditEntry.Action.QUOTA_TEAM, target="t", message="m"
    )
    AuditEntry.objects.filter(pk=entry.pk).update(at=afternoon)
    client.force_login(admin_user)
    audit = client.get(reverse("admin:portal_auditentry_changelist")).content.decode()
    assert "Mon 2030-03-04 15:30" in audit
    assert "p.m." not in audit

    start = timezone.now().replace(hour=14, minute=5, second=0, microsecond=0) + timedelta(days=1)
    reservation_create(user=alice, gpus=[box[0].uuid], start=start, end=start.replace(hour=17, minute=0))
    bookings = client.get(reverse("admin:gpus_reservation_changelist")).content.decode()
    assert f"{start:%a %Y-%m-%d} 14:05" in bookings and f"{start:%a %Y-%m-%d} 17:00" in bookings
    assert "p.m." not in bookings
