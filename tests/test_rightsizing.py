"""Right-sizing: the size hint from a user's recent runs of a script (the arithmetic, the forms'
partial, the API) and the leaders' report of bookings and people who use little of what they book."""

from __future__ import annotations

from datetime import timedelta
from itertools import count

import pytest
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.models import GPU, Reservation
from jobs.models import Job
from jobs.rightsizing import peak_per_card, script_name, size_hint_for, suggest
from tests.browser import log_in, page  # noqa: F401 - the fixture

GIB = 1024
HEADROOM = 512  # settings.GPU_CONTEXT_HEADROOM_MB's default, which the tests keep
_created = count()


@pytest.fixture(autouse=True)
def _headroom(settings) -> None:
    settings.GPU_CONTEXT_HEADROOM_MB = HEADROOM


@pytest.fixture
def people(alice, bob, leader, charlie, admin_user) -> dict:
    """alice owns the jobs, bob is her teammate, charlie an outsider, then her team's leader and an admin."""
    return {"alice": alice, "bob": bob, "charlie": charlie, "leader": leader, "admin": admin_user}


def booked(user, gpu: GPU, memory_mb: int | None) -> Reservation:
    return reservation_create(user=user, gpus=[gpu.uuid], memory_mb=memory_mb)


def ran(
    booking: Reservation,
    *,
    name: str = "train.py",
    peak_mb: int | None,
    utilization_pct: float = 50,
    status: str = Job.Status.SUCCEEDED,
    finished_ago: timedelta = timedelta(hours=1),
) -> Job:
    """A finished job on the booking as the worker and telemetry leave it; each newer than the last."""
    finished_at = timezone.now() - finished_ago
    return Job.objects.create(
        owner=booking.owner,
        team=booking.team,
        reservation=booking,
        server=booking.allocations.first().gpu.server,
        gpu_uuids=[a.gpu_id for a in booking.allocations.all()],
        name=name,
        status=status,
        created_at=finished_at - timedelta(minutes=30) + timedelta(microseconds=next(_created)),
        started_at=finished_at - timedelta(minutes=30),
        finished_at=finished_at,
        peak_memory_mb=peak_mb,
        utilization_sum=utilization_pct * 10,
        utilization_samples=10,
    )


# --- the arithmetic -------------------------------------------------------------------------------


def hint(runs: list[tuple[int, int]], largest_card_mb: int = 80 * GIB):
    return suggest("train.py", runs, largest_card_mb=largest_card_mb, headroom_mb=HEADROOM)


def test_it_needs_three_runs():
    assert hint([(9318, 24 * GIB)] * 2) is None
    assert hint([(9318, 24 * GIB)] * 3) is not None


def test_it_adds_the_headroom_and_the_margin_and_rounds_up_to_a_whole_gib():
    # 9.1 GiB peak: (9318 + 512) × 1.2 = 11,796 MiB → 12 GiB, the issue's own example.
    found = hint([(9318, 24 * GIB)] * 10)
    assert (found.runs, found.peak_mb, found.booked_mb, found.suggested_mb) == (10, 9318, 24 * GIB, 12 * GIB)
    assert found.text == (
        "Your last 10 runs of train.py peaked at 9.1 GiB of 24 GiB booked per card; 12 GiB would do."
    )
    assert found.memory_input == "12G"
    assert hint([(2 * GIB, 24 * GIB)] * 3).suggested_mb == 3 * GIB  # (2048 + 512) × 1.2 = 3072 exactly
    assert hint([(2 * GIB + 1, 24 * GIB)] * 3).suggested_mb == 4 * GIB  # a MiB more is the next GiB


def test_it_takes_the_highest_peak_and_what_the_latest_run_booked():
    found = hint([(4 * GIB, 20 * GIB), (9318, 24 * GIB), (1 * GIB, 24 * GIB)])
    assert (found.peak_mb, found.booked_mb, found.suggested_mb) == (9318, 20 * GIB, 12 * GIB)


def test_it_never_suggests_more_than_the_largest_card():
    found = hint([(60 * GIB, 200 * GIB)] * 3, largest_card_mb=70_000)
    assert found.suggested_mb == 70_000
    assert found.memory_input == "70000M"


def test_it_says_nothing_when_the_runs_already_book_about_right():
    assert hint([(9318, 13 * GIB)] * 3) is None  # 12 GiB ≥ 90 % of 13 GiB
    assert hint([(9318, 12 * GIB)] * 3) is None
    assert hint([(9318, 14 * GIB)] * 3).suggested_mb == 12 * GIB  # 12 < 12.6


def test_a_peak_splits_over_the_cards_only_with_mirrored_strategy():
    assert peak_per_card(8000, 2, mirrored=True) == 4000
    assert peak_per_card(8001, 2, mirrored=True) == 4001  # rounded up
    # Without it TensorFlow uses the first card: the whole peak may sit there.
    assert peak_per_card(8000, 2, mirrored=False) == 8000
    assert peak_per_card(8000, 1, mirrored=True) == 8000


def test_a_script_is_named_by_its_file_name():
    assert script_name("train.py") == "train.py"
    assert script_name(" /data/jobs/src/train.py ") == "train.py"
    assert script_name("C:\\fakepath\\train.py") == "train.py"


# --- the user's runs ------------------------------------------------------------------------------


def test_it_reads_only_the_users_own_runs_of_that_script(alice, bob, box):
    mine, bobs = booked(alice, box[0], 20 * GIB), booked(bob, box[1], 20 * GIB)
    for _ in range(2):
        ran(mine, peak_mb=9318)
    for _ in range(3):
        ran(bobs, peak_mb=9318)  # bob's runs of the same script
        ran(mine, name="eval.py", peak_mb=9318)  # another script of alice's
    ran(mine, peak_mb=None)  # telemetry never saw it
    assert size_hint_for(alice, "train.py") is None
    assert size_hint_for(bob, "train.py").suggested_mb == 12 * GIB

    ran(mine, peak_mb=9318, status=Job.Status.FAILED)  # a failed run counts: its peak is real
    found = size_hint_for(alice, "jobs/train.py")
    assert (found.runs, found.booked_mb, found.suggested_mb) == (3, 20 * GIB, 12 * GIB)


def test_it_reads_the_last_ten_runs_only(alice, box):
    booking = booked(alice, box[0], 20 * GIB)
    ran(booking, peak_mb=20 * GIB)  # the oldest: left out
    for _ in range(10):
        ran(booking, peak_mb=9318)
    assert size_hint_for(alice, "train.py").peak_mb == 9318


def test_a_whole_card_counts_its_bookable_memory(alice, box):
    booking = booked(alice, box[0], None)
    for _ in range(3):
        ran(booking, peak_mb=9318)
    found = size_hint_for(alice, "train.py")
    assert found.booked_mb == box[0].memory_bookable_mb == 24 * GIB - 300 - HEADROOM
    assert found.suggested_mb == 12 * GIB


def test_without_a_script_it_takes_the_most_frequent(alice, box):
    booking = booked(alice, box[0], 20 * GIB)
    for _ in range(3):
        ran(booking, peak_mb=9318)
    ran(booking, name="eval.py", peak_mb=1000)
    assert size_hint_for(alice, None).script == "train.py"
    assert size_hint_for(alice, "").script == "train.py"


# --- the API --------------------------------------------------------------------------------------


def test_the_api_answers_for_the_callers_own_runs_only(alice, bob, box):
    booking = booked(alice, box[0], 20 * GIB)
    for _ in range(3):
        ran(booking, peak_mb=9318)
    api = APIClient()
    api.force_authenticate(alice)
    response = api.get("/api/v1/jobs/size-hint/", {"script": "train.py"})
    assert response.status_code == 200
    assert response.json() == {
        "script": "train.py",
        "runs": 3,
        "peak_mb": 9318,
        "booked_mb": 20 * GIB,
        "suggested_mb": 12 * GIB,
        "text": "Your last 3 runs of train.py peaked at 9.1 GiB of 20 GiB booked per card; 12 GiB would do.",
    }
    assert api.get("/api/v1/jobs/size-hint/", {"script": "eval.py"}).status_code == 204
    api.force_authenticate(bob)
    response = api.get("/api/v1/jobs/size-hint/", {"script": "train.py"})
    assert response.status_code == 204 and response.content == b""
    api.force_authenticate(None)
    assert api.get("/api/v1/jobs/size-hint/", {"script": "train.py"}).status_code in (401, 403)


# --- the forms ------------------------------------------------------------------------------------


@pytest.fixture
def three_runs(alice, box) -> Reservation:
    booking = booked(alice, box[0], 20 * GIB)
    for _ in range(3):
        ran(booking, peak_mb=9318)
    return booking


def test_the_job_form_asks_for_the_hint_of_the_chosen_script(client, alice, three_runs):
    client.force_login(alice)
    html = client.get(reverse("job_new")).content.decode()
    assert f'hx-get="{reverse("job_size_hint")}"' in html
    assert "change from:#id_script, change from:#id_script_path" in html
    assert 'name="memory"' in html and 'id="id_memory"' in html  # what "Use" fills


def test_the_booking_form_asks_for_the_hint_of_a_typed_or_the_most_frequent_script(client, alice, three_runs):
    client.force_login(alice)
    html = client.get(reverse("reservation_new")).content.decode()
    assert f'hx-get="{reverse("job_size_hint")}" hx-trigger="load"' in html
    assert 'id="size-hint-script" name="script"' in html
    assert 'id="id_memory"' in html


def test_the_hint_partial_shows_the_text_and_fills_the_memory_field_in_one_click(client, alice, three_runs):
    client.force_login(alice)
    for query in ({"script": "/data/jobs/train.py"}, {}):  # the job form's path; the booking form's default
        html = client.get(reverse("job_size_hint"), query).content.decode()
        assert (
            "Your last 3 runs of train.py peaked at 9.1 GiB of 20 GiB booked per card; 12 GiB would do."
            in html
        )
        # static/js/portal.js fills it (no inline handler: the pages' Content-Security-Policy)
        assert 'data-fill="#id_memory" data-value="12G"' in html
        assert ">Use 12G</button>" in html


def test_the_hint_partial_is_empty_without_a_hint(client, alice, bob, three_runs):
    client.force_login(bob)
    response = client.get(reverse("job_size_hint"), {"script": "train.py"})
    assert response.status_code == 200 and response.content.strip() == b""


# --- the leaders' report --------------------------------------------------------------------------


def report(client, who, **query):
    client.force_login(who)
    return client.get(reverse("team_rightsizing", args=["vision-lab"]), query)


@pytest.mark.parametrize(
    ("who", "expected"), [("alice", 403), ("bob", 403), ("charlie", 404), ("leader", 200), ("admin", 200)]
)
def test_the_report_is_for_the_teams_leaders_and_admins(client, people, who, expected):
    assert report(client, people[who]).status_code == expected


def test_the_team_page_links_to_the_report(client, people):
    client.force_login(people["leader"])
    html = client.get(reverse("team_detail", args=["vision-lab"])).content.decode()
    assert reverse("team_rightsizing", args=["vision-lab"]) in html


def test_the_report_lists_what_stays_below_half_the_booking_and_a_fifth_busy(client, people, box):
    alice, bob = people["alice"], people["bob"]
    low = booked(alice, box[0], 10 * GIB)
    ran(low, peak_mb=4 * GIB, utilization_pct=10)  # 40 % of the booking, 10 % busy: listed
    ran(low, peak_mb=3 * GIB, utilization_pct=12)
    busy = booked(bob, box[1], 10 * GIB)
    ran(busy, peak_mb=2 * GIB, utilization_pct=30)  # little memory but busy: not listed
    full = booked(bob, box[2], 10 * GIB)
    ran(full, peak_mb=5 * GIB, utilization_pct=5)  # exactly half: not below it
    old = booked(bob, box[3], 10 * GIB)
    ran(old, peak_mb=1 * GIB, utilization_pct=5, finished_ago=timedelta(days=40))  # before the period

    response = report(client, people["leader"])
    assert response.status_code == 200
    [(booking, use)] = response.context["bookings"]
    assert booking == low
    assert (use.jobs, use.peak_mb, use.booked_mb, use.peak_pct, use.mean_utilization_pct) == (
        2,
        4 * GIB,
        10 * GIB,
        40.0,
        11.0,
    )
    assert [(person.username, use.jobs) for person, use in response.context["people"]] == [("alice", 2)]
    html = response.content.decode()
    assert f'data-reservation="{low.pk}"' in html and "40.0 %" in html and "11.0 %" in html
    assert f'data-reservation="{busy.pk}"' not in html and f'data-reservation="{full.pk}"' not in html

    # Over 90 days the old booking is in, and bob with it: his jobs there and then peaked at 10 %…
    response = report(client, people["admin"], days="90")
    assert {b.pk for b, _ in response.context["bookings"]} == {low.pk, old.pk}
    # …but a person is judged over all their jobs: bob's 50 % and busy runs keep him off the list.
    assert [person.username for person, _ in response.context["people"]] == ["alice"]
    # A period the page does not offer falls back to 30 days.
    assert {b.pk for b, _ in report(client, people["admin"], days="4000").context["bookings"]} == {low.pk}


def test_the_report_shows_only_the_teams_own_jobs(client, people, box):
    outsider = booked(people["charlie"], box[0], 10 * GIB)
    ran(outsider, peak_mb=1 * GIB, utilization_pct=1)
    response = report(client, people["admin"])
    assert response.context["bookings"] == [] and response.context["people"] == []


# --- in a browser ---------------------------------------------------------------------------------


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_the_hint_appears_after_a_few_jobs_and_one_click_fills_the_memory(page, alice, box):  # noqa: F811
    from playwright.sync_api import expect

    booking = booked(alice, box[0], 20 * GIB)
    for _ in range(3):
        ran(booking, peak_mb=9318)
    log_in(page, "alice")
    text = "Your last 3 runs of train.py peaked at 9.1 GiB of 20 GiB booked per card; 12 GiB would do."

    # The booking form: the most frequent script's hint at once; a typed script's as it is typed.
    page.goto(reverse("reservation_new"))
    expect(page.locator("#size-hint")).to_contain_text(text)
    page.click("#size-hint button")
    expect(page.locator("#id_memory")).to_have_value("12G")
    page.fill("#size-hint-script", "eval.py")
    expect(page.locator("#size-hint")).to_be_empty()

    # The job form: the chosen upload's file name.
    page.goto(reverse("job_new"))
    page.set_input_files(
        "#id_script", files=[{"name": "eval.py", "mimeType": "text/x-python", "buffer": b"1"}]
    )
    expect(page.locator("#size-hint")).to_be_empty()
    page.set_input_files(
        "#id_script", files=[{"name": "train.py", "mimeType": "text/x-python", "buffer": b"1"}]
    )
    expect(page.locator("#size-hint")).to_contain_text(text)
    page.click("#size-hint button")
    expect(page.locator("#id_memory")).to_have_value("12G")
