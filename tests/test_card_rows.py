"""The dashboard's card rows, rendered once for what each shows (gpus/card_rows.py): a row kept for
one viewer or one telemetry round is never shown for another that would see it otherwise."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from gpus import card_rows
from gpus.models import GPUProcess
from gpus.services import server_report_ingest
from tests.factories import make_snapshot

pytestmark = pytest.mark.django_db

SECRET = "python train.py --token s3cret-of-alice"


def _live(user) -> str:  # type: ignore[no-untyped-def]
    client = Client()
    client.force_login(user)
    return client.get(reverse("dashboard_servers")).content.decode()


def _fresh(user) -> str:  # type: ignore[no-untyped-def]
    card_rows.forget()
    return _live(user)


def test_each_viewer_sees_their_own_row_of_the_same_card(alice, bob, admin_user, box):
    GPUProcess.objects.filter(gpu=box[0]).update(command=SECRET)

    pages = [_live(user) for user in (alice, bob, admin_user, bob, alice)]

    assert [SECRET in page for page in pages] == [True, False, True, False, True]
    assert pages[0] == pages[4] == _fresh(alice) and pages[1] == pages[3] == _fresh(bob)


def test_a_telemetry_round_shows_its_new_figures(alice, box):
    before = _live(alice)
    server_report_ingest(snapshot=make_snapshot("box1", gpus=4, util=77))

    after = _live(alice)

    assert 'data-field="utilization">10%<' in before and 'data-field="utilization">77%<' in after
    assert after == _fresh(alice)


def test_what_is_kept_is_bounded_and_the_rows_stay_right(alice, box, monkeypatch):
    monkeypatch.setattr(card_rows, "KEPT", 3)
    expected = _fresh(alice)

    for util in (20, 30, 10):
        server_report_ingest(snapshot=make_snapshot("box1", gpus=4, util=util))
        page = _live(alice)
        assert len(card_rows._rendered) <= 3

    assert page == expected
