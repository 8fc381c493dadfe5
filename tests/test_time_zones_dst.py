"""The nights the clocks change: a lab whose TIME_ZONE is not UTC, and people whose own zone differs
from it (a hostile review's findings). The dates are 2027's, past any "today" the suite runs on."""

from __future__ import annotations

import zoneinfo
from datetime import UTC, datetime, timedelta

import pytest

from gpus.models import Reservation

pytestmark = pytest.mark.django_db

BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")


def _book(client, box, start: str, end: str):
    return client.post(
        "/reservations/new/",
        {"server": "box1", "gpus": [box[0].uuid], "start": start, "end": end, "memory": ""},
    )


@pytest.fixture
def far_horizon(settings):
    """Bookings may reach the next DST changes (2027's) from whatever today is."""
    settings.BOOKING_HORIZON_DAYS = 800


def test_a_24_hour_limit_refuses_a_25_hour_booking_across_the_autumn_change(client, alice, box, far_horizon):
    """2027-10-30 12:00 to 2027-10-31 12:00 in Berlin is 25 hours (the clocks go back an hour that
    night): a member who may book at most 24 h must be refused, as she is for any other 25 h."""
    alice.memberships.update(max_booking_hours=24)
    client.cookies["browser_tz"] = "Europe/Berlin"
    client.force_login(alice)
    answer = _book(client, box, "2027-10-30T12:00", "2027-10-31T12:00")
    assert not Reservation.objects.exists()
    assert answer.status_code == 200 and "at most 24 h" in answer.content.decode()


def test_a_24_hour_limit_takes_a_24_hour_booking_across_the_spring_change(client, alice, box, far_horizon):
    """2027-03-27 12:00 to 2027-03-28 13:00 in Berlin is 24 hours (the clocks go forward that night)."""
    alice.memberships.update(max_booking_hours=24)
    client.cookies["browser_tz"] = "Europe/Berlin"
    client.force_login(alice)
    answer = _book(client, box, "2027-03-27T12:00", "2027-03-28T13:00")
    assert answer.status_code == 302, answer.context["form"].errors
    made = Reservation.objects.get()
    assert made.end - made.start == timedelta(hours=24)


def _api(user):
    from rest_framework.test import APIClient

    api = APIClient()
    api.force_authenticate(user)
    return api


def test_the_api_counts_a_bookings_real_length_across_the_autumn_change(alice, box, settings, far_horizon):
    """The same 25 hours through the API, in a lab whose TIME_ZONE is Berlin: DRF hands the times
    over in the request's zone, and a 25-hour booking must not pass a 24-hour limit."""
    settings.TIME_ZONE = "Europe/Berlin"
    alice.memberships.update(max_booking_hours=24)
    answer = _api(alice).post(
        "/api/v1/reservations/",
        {"gpus": [box[0].uuid], "start": "2027-10-30T10:00:00Z", "end": "2027-10-31T11:00:00Z"},
        format="json",
    )
    assert answer.status_code == 400 and not Reservation.objects.exists(), answer.json()
    assert "at most 24 h" in str(answer.json()), answer.json()


def test_the_weekly_quota_counts_a_bookings_real_hours_across_the_autumn_change(
    client, alice, box, far_horizon
):
    """A 24 GPU-hour week, and a booking of 25 real hours inside one week (the night the clocks go
    back), typed by someone whose zone is the portal's own: refused, as any 25-hour booking is."""
    from django.test import override_settings

    alice.memberships.update(gpu_hours_per_week=24)
    with override_settings(TIME_ZONE="Europe/Berlin"):
        client.force_login(alice)
        answer = _book(client, box, "2027-10-30T12:00", "2027-10-31T12:00")
    assert answer.status_code == 200 and not Reservation.objects.exists()
    assert "24 GPU-hours" in str(answer.context["form"].errors)


def test_the_api_refuses_a_time_that_does_not_exist_naming_the_field(alice, box, settings, far_horizon):
    """2027-03-28 02:30 never happens in Berlin (02:00 becomes 03:00). The booking form refuses it
    beside its field; the API must not book some other hour in silence."""
    settings.TIME_ZONE = "Europe/Berlin"
    answer = _api(alice).post(
        "/api/v1/reservations/",
        {"gpus": [box[0].uuid], "start": "2027-03-28T02:30", "end": "2027-03-28T05:00"},
        format="json",
    )
    assert answer.status_code == 400, (answer.status_code, Reservation.objects.values("start").first())
    assert "start" in str(answer.json())


def test_the_form_refuses_a_time_that_does_not_exist_naming_the_field(client, alice, box, far_horizon):
    client.cookies["browser_tz"] = "Europe/Berlin"
    client.force_login(alice)
    answer = _book(client, box, "2027-03-28T02:30", "2027-03-28T05:00")
    assert answer.status_code == 200 and "start" in answer.context["form"].errors, list(
        Reservation.objects.values("start", "end")
    )


def test_a_booking_over_a_whole_spring_week_counts_167_gpu_hours_in_it(alice, box, settings):
    """The week of 2027-03-22 in Berlin is 167 hours long (the clocks go forward on its Sunday). A
    booking of one card from the Sunday before to the Monday after holds 167 GPU-hours of that week:
    a member who may book 167 GPU-hours a week may make it, and the team page counts 167, not 168."""
    from gpus.booking import reservation_create
    from gpus.quota_usage import team_use

    settings.TIME_ZONE = "Europe/Berlin"
    alice.memberships.update(gpu_hours_per_week=167)
    week, following = datetime(2027, 3, 22, tzinfo=BERLIN), datetime(2027, 3, 29, tzinfo=BERLIN)
    assert following.timestamp() - week.timestamp() == 167 * 3600
    start = (week - timedelta(hours=1)).astimezone(UTC)  # UTC, as the database hands times back
    end = (following + timedelta(hours=1)).astimezone(UTC)
    booking = reservation_create(user=alice, gpus=[box[0].uuid], start=start, end=end, now=start)
    use = team_use(booking.team, now=datetime(2027, 3, 24, 12, tzinfo=UTC))
    assert use[alice.pk].gpu_hours_week == 167.0


def test_the_watchdogs_announced_stop_names_its_zone(settings):
    """The worker writes in TIME_ZONE (Berlin here) and must say so: the person told "it will be
    stopped at 13:05:00" may be in New York, where every page shows their own zone."""
    from gpus.inventory import ProcessInfo
    from jobs.watchdog.records import announced_step

    settings.TIME_ZONE, settings.WATCHDOG_DRY_RUN = "Europe/Berlin", False
    said = announced_step("stop", 300, datetime(2027, 1, 4, 12, tzinfo=UTC), ProcessInfo(1, "bob", "python"))
    assert "13:05" in said and "CET" in said, said


def test_a_labs_end_said_with_the_database_away_is_in_the_zone_it_names(monkeypatch, settings):
    """A JupyterLab session's end, said while the database is away, reads as when it is not
    (format_time: the portal's zone, named), never a bare UTC clock ("ended at 11:00")."""
    from django.db import DatabaseError

    from jobs.host import lab

    def away() -> None:
        raise DatabaseError("the database is away")

    settings.TIME_ZONE = "Europe/Berlin"
    monkeypatch.setattr(lab, "close_old_connections", away)
    supervisor = object.__new__(lab.LabSupervisor)
    supervisor.pk, supervisor.database_away = 1, False
    supervisor.ends_at = datetime(2020, 1, 6, 11, tzinfo=UTC)  # long past; as the database gives it
    said = supervisor._check_row()
    assert said == "the booking ended at Mon 2020-01-06 12:00 CET", said


def test_a_tokens_audit_entry_names_the_zone_of_its_expiry(alice):
    """Every other audit line says its times with format_time (zone named); a token's expiry is
    written in whatever zone its datetime carries, unnamed."""
    from django.utils import timezone

    from portal.models import AuditEntry
    from portal.services import api_token_create
    from portal.timefmt import format_time

    expires = datetime(2027, 1, 4, 23, 30, tzinfo=UTC)
    with timezone.override("Asia/Kolkata"):
        api_token_create(user=alice, name="laptop", expires_at=expires)
        assert format_time(expires) in AuditEntry.objects.get().message


def test_gpu_cli_reads_a_clock_time_tomorrow_in_tomorrows_offset(monkeypatch):
    """`gpu book --start 14:00` on the Saturday afternoon before the clocks go forward means
    Sunday 14:00 CEST (12:00 UTC), not Sunday 14:00 at Saturday's offset (13:00 UTC)."""
    import time

    import gpu_cli.params as params

    class Saturday(datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[override]
            return datetime(2027, 3, 27, 15, 0)  # naive, local: as datetime.now() is

    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    monkeypatch.setattr(params, "datetime", Saturday)
    try:
        at = params.When().convert("14:00", None, None)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert at.astimezone(UTC) == datetime(2027, 3, 28, 12, tzinfo=UTC), at


def test_a_queued_jobs_begin_time_that_does_not_exist_is_refused_naming_the_field(settings):
    """The API's `begin_at` reads a time without an offset as the booking's times are read."""
    from rest_framework.exceptions import ValidationError

    from jobs.api import JobCreateSerializer
    from portal.api_fields import LocalDateTimeField

    settings.TIME_ZONE = "Europe/Berlin"
    field = JobCreateSerializer().fields["begin_at"]
    assert isinstance(field, LocalDateTimeField)
    with pytest.raises(ValidationError, match="does not exist, or happens twice, in Europe/Berlin"):
        field.run_validation("2027-03-28T02:30")
    with pytest.raises(ValidationError, match="happens twice"):
        field.run_validation("2027-10-31T02:30")  # the clocks go back: 02:30 CEST and 02:30 CET
    # In UTC: an aware time in a repeated hour never equals another zone's (PEP 495).
    assert field.run_validation("2027-10-31T02:30+01:00").astimezone(UTC) == datetime(
        2027, 10, 31, 1, 30, tzinfo=UTC
    )
    assert field.run_validation("2027-03-28T03:30").astimezone(UTC) == datetime(
        2027, 3, 28, 1, 30, tzinfo=UTC
    )
