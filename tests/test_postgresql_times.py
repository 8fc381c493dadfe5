"""Times read from PostgreSQL by psycopg's own loader (portal/postgresql/base.py): the same aware
UTC datetimes Django's loader gives, and Django's own loader where it wants another zone."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import psycopg
import pytest
from django.db import connection
from django.test import override_settings

from gpus.models import Server

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _postgresql_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the PostgreSQL backend's loader")


def _loader_class() -> type:
    with connection.cursor() as cursor:
        return type(cursor.cursor.adapters.get_loader(1184, psycopg.pq.Format.TEXT)(1184, cursor.cursor))


def test_it_reads_times_as_aware_utc_datetimes_by_psycopgs_loader():
    seen = datetime(2026, 3, 29, 1, 30, 15, 123456, tzinfo=timezone(timedelta(hours=2)))
    Server.objects.filter(pk=Server.objects.create(name="gpu1").pk).update(last_seen=seen)

    read = Server.objects.get(name="gpu1").last_seen
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::timestamptz, 'infinity'::timestamptz < now()", ["2026-01-01 00:00:00-05"])
        value, _ = cursor.fetchone()

    assert read == seen and read.tzinfo is UTC and read.hour == 23 and read.microsecond == 123456
    assert value == datetime(2026, 1, 1, 5, tzinfo=UTC) and value.tzinfo is UTC
    assert _loader_class() is psycopg.adapters.get_loader(1184, psycopg.pq.Format.TEXT)


@override_settings(USE_TZ=False)  # Django forgets its connection's zone (django.test.signals)
def test_it_leaves_naive_times_to_djangos_loader():
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::timestamptz", ["2026-01-01 00:00:00+00"])
        (value,) = cursor.fetchone()

    assert value == datetime(2026, 1, 1) and value.tzinfo is None
