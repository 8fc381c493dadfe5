"""The suite's own flush after a transactional test (tests/flushing.py)."""

from __future__ import annotations

import pytest
from django.core.management.color import no_style
from django.core.management.commands import flush
from django.db import connection

from gpus.models import Reservation
from portal.models import Team
from tests.factories import TeamFactory


@pytest.mark.django_db
def test_on_postgresql_it_deletes_under_a_lock_and_leaves_the_rest_to_django():
    statements = flush.sql_flush(no_style(), connection, reset_sequences=False, allow_cascade=False)
    if connection.vendor != "postgresql":
        assert not any(s.startswith(("LOCK", "SET CONSTRAINTS")) for s in statements)
        return
    assert statements[0] == "SET CONSTRAINTS ALL DEFERRED"
    assert statements[1].startswith("LOCK TABLE ") and statements[1].endswith(" IN SHARE MODE")
    deleted = {s.removeprefix("DELETE FROM ").strip('"') for s in statements[2:]}
    assert {Team._meta.db_table, Reservation._meta.db_table} <= deleted
    assert "django_migrations" not in deleted
    for asked in ({"reset_sequences": True}, {"reset_sequences": False, "allow_cascade": True}):
        (django_s,) = flush.sql_flush(no_style(), connection, **asked)
        assert django_s.startswith("TRUNCATE "), django_s


@pytest.mark.django_db(transaction=True)
def test_a_transactional_test_commits_rows_with_foreign_keys():
    """With the next one, in either order: the flush between them emptied the tables (parents
    and children, whatever their order) and put the content types back."""
    TeamFactory(name="flushed-team")
    assert Team.objects.filter(name="flushed-team").exists()


@pytest.mark.django_db(transaction=True)
def test_the_flush_left_nothing_of_the_other_test():
    from django.contrib.contenttypes.models import ContentType

    assert not Team.objects.filter(name="flushed-team").exists()
    assert ContentType.objects.get_for_model(Team).model == "team"
