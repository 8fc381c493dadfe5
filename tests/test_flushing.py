"""The suite's own flush after a transactional test (tests/flushing.py)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.core.management.color import no_style
from django.core.management.commands import flush
from django.db import connection

from gpus.models import Reservation
from portal.models import Membership, Team
from tests.factories import MembershipFactory, TeamFactory, UserFactory


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
def test_the_flush_a_transactional_test_ends_with_empties_every_table_and_keeps_the_registry():
    """The flush as TransactionTestCase's teardown calls it, on committed rows whose foreign keys
    point at a table that sorts, and so is emptied, before theirs (auth_user < portal_membership)."""
    user = UserFactory(username="flushed")
    membership = MembershipFactory(team=TeamFactory(name="flushed-team"), user=user)
    team_type = ContentType.objects.get_for_model(Team)
    call_command("flush", verbosity=0, interactive=False, reset_sequences=False, allow_cascade=False)
    assert not Team.objects.exists() and not Membership.objects.exists()
    assert not get_user_model().objects.exists()
    ContentType.objects.clear_cache()
    assert ContentType.objects.get_for_model(Team) == team_type  # put back, its id kept
    assert Permission.objects.filter(content_type=team_type).exists()
    later = TeamFactory(name="after-the-flush")
    assert later.pk > membership.team.pk  # sequences go on counting, as after TRUNCATE
