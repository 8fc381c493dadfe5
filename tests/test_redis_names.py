"""Two portals on one Redis (issue 32): every key and channel carries PORTAL_INSTANCE_ID, so one
portal never takes the other's telemetry reports or wake-ups."""

from __future__ import annotations

import pytest

from gpus.telemetry import publish_snapshot, redis_client, reports_key, take_reports
from jobs.logs.live import channel as job_channel
from portal import wakeups
from portal.changes import channel, user_channel
from portal.names import redis_key
from tests.factories import make_snapshot


@pytest.fixture
def two_instances(settings):
    """Clean keys for instances "one" and "two", before and after."""
    client = redis_client()
    keys = [redis_key(i, *k) for i in ("one", "two") for k in (("telemetry", "reports"), ("wake", "test"))]
    client.delete(*keys)
    yield client
    client.delete(*keys)


def test_each_key_and_channel_names_its_instance(settings):
    settings.PORTAL_INSTANCE_ID = "lab-a"
    names = [reports_key(), wakeups.key("queue"), channel(), user_channel(3), job_channel(7)]
    assert all(name.startswith("portal:lab-a:") for name in names)
    settings.PORTAL_INSTANCE_ID = "lab-b"
    assert not set(names) & {reports_key(), wakeups.key("queue"), channel(), user_channel(3), job_channel(7)}


def test_two_instances_do_not_take_each_others_telemetry(settings, two_instances):
    settings.PORTAL_INSTANCE_ID = "one"
    publish_snapshot(two_instances, make_snapshot("box1", gpus=1))
    settings.PORTAL_INSTANCE_ID = "two"
    assert take_reports(two_instances) == []  # not "one"'s report
    publish_snapshot(two_instances, make_snapshot("box2", gpus=1))
    settings.PORTAL_INSTANCE_ID = "one"
    assert [s.host.name for s in take_reports(two_instances)] == ["box1"]
    settings.PORTAL_INSTANCE_ID = "two"
    assert [s.host.name for s in take_reports(two_instances)] == ["box2"]


def test_two_instances_do_not_wake_each_other(settings, two_instances):
    settings.PORTAL_INSTANCE_ID = "one"
    wakeups.wake("test")
    settings.PORTAL_INSTANCE_ID = "two"
    assert not wakeups.wait(two_instances, "test", 1)  # "one"'s wake-up is not for this portal
    settings.PORTAL_INSTANCE_ID = "one"
    assert wakeups.wait(two_instances, "test", 1)
