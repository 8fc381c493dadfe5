"""The reporter → Redis → collector path, against the configured (real) Redis."""

import pytest

from gpus.models import GPU, Server
from gpus.telemetry import collect_once, publish_snapshot, redis_client, reports_key, take_reports
from tests.factories import make_snapshot

pytestmark = pytest.mark.django_db


@pytest.fixture
def client():
    client = redis_client()
    client.delete(reports_key())
    yield client
    client.delete(reports_key())


def test_it_keeps_only_each_hosts_latest_report(client):
    publish_snapshot(client, make_snapshot("box1", gpus=1, util=10))
    publish_snapshot(client, make_snapshot("box1", gpus=1, util=90))
    publish_snapshot(client, make_snapshot("box2", gpus=2))
    reports = {s.host.name: s for s in take_reports(client)}
    assert set(reports) == {"box1", "box2"}
    assert reports["box1"].gpus[0].utilization_pct == 90
    assert take_reports(client) == []  # taken means gone: no report is written twice


def test_it_collects_every_host_into_the_database(client):
    for name in ("box1", "box2", "box3"):
        publish_snapshot(client, make_snapshot(name, gpus=2, processes=1))
    assert collect_once(client) == 3
    assert Server.objects.count() == 3
    assert GPU.objects.count() == 6
    assert collect_once(client) == 0


def test_it_drops_a_malformed_report_and_keeps_the_rest(client, caplog):
    publish_snapshot(client, make_snapshot("box1", gpus=1))
    client.hset(reports_key(), "evil", b"{not json")
    assert collect_once(client) == 1
    assert "malformed telemetry report from 'evil'" in caplog.text
