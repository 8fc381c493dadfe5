"""Admins and servers (gpus/servers.py): a GPU host joins by itself, so the admin adds only Slurm
clusters and says how a host joins, as does an admin's empty dashboard; draining on the server's
page, with what it means and the audit log; the booking form saying why a server is not offered."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client
from django.urls import reverse

from gpus.booking import reservation_create
from gpus.models import Server
from gpus.servers import HOST_JOIN_START, HOST_JOIN_UNIT, server_drain_set
from portal.errors import Forbidden, Invalid
from portal.models import AuditEntry
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_user(db):
    return UserFactory(username="admin", is_staff=True, is_superuser=True)


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


# --- how a GPU host joins ------------------------------------------------------------------------


def test_docs_deploy_runs_the_command_the_portal_shows():
    """The admin's server list and empty dashboard say what docs/deploy.md's steps run."""
    deploy = (Path(settings.BASE_DIR) / "docs" / "deploy.md").read_text()
    assert f"`{HOST_JOIN_UNIT} && {HOST_JOIN_START}`" in deploy


def test_an_admin_with_no_server_is_told_what_to_run_on_a_gpu_host(admin_user, alice):
    page = client_for(admin_user).get(reverse("dashboard")).content.decode()
    assert "No server has reported yet." in page and "systemctl enable --now gpu-portal-worker" in page
    page = client_for(alice).get(reverse("dashboard")).content.decode()
    assert "an admin starts the portal's worker on each GPU host" in page
    assert "systemctl" not in page


def test_the_admins_server_list_says_how_a_host_joins_and_adds_only_slurm_clusters(admin_user):
    client = client_for(admin_user)
    page = client.get(reverse("admin:gpus_server_changelist")).content.decode()
    assert "A GPU host joins by itself" in page and "systemctl enable --now gpu-portal-worker" in page
    assert "Add a Slurm cluster" in page and "Add server" not in page
    form = client.get(reverse("admin:gpus_server_add")).content.decode()
    assert 'name="driver_version"' not in form and 'name="cpu_count"' not in form
    assert 'name="gpus-0-memory_used_mb"' not in form
    # A GPU host typed in by hand is refused: only a Slurm cluster's kind is offered.
    answer = client.post(reverse("admin:gpus_server_add"), _add_form("ghost", "host"))
    assert answer.status_code == 200 and "Select a valid choice" in answer.content.decode()
    assert not Server.objects.filter(name="ghost").exists()
    answer = client.post(reverse("admin:gpus_server_add"), _add_form("cluster-a", "slurm"))
    assert answer.status_code == 302
    assert Server.objects.get(name="cluster-a").kind == Server.Kind.SLURM


def _add_form(name: str, kind: str) -> dict[str, str]:
    return {
        "name": name,
        "kind": kind,
        "slurm-TOTAL_FORMS": "0",
        "slurm-INITIAL_FORMS": "0",
        "slurm-MIN_NUM_FORMS": "0",
        "slurm-MAX_NUM_FORMS": "1",
    }


def test_what_a_host_reports_is_read_only_in_the_admin(admin_user, box):
    server = box[0].server
    form = client_for(admin_user).get(reverse("admin:gpus_server_change", args=[server.pk])).content.decode()
    for field in ("driver_version", "cpu_count", "ram_mb", "hostname", "draining"):
        assert f'name="{field}"' not in form, field


# --- draining ------------------------------------------------------------------------------------


def test_an_admin_drains_and_undrains_on_the_servers_page(admin_user, box, alice):
    server = box[0].server
    reservation_create(user=alice, gpus=[box[0].uuid])
    client = client_for(admin_user)
    page = client.get(reverse("server_timeline", args=[server.name])).content.decode()
    assert "Drain box1" in page and "No new bookings of its cards" in page and "Now 1 booking holds" in page
    drain = reverse("server_drain", args=[server.name])
    answer = client.post(drain, {"draining": "on", "reason": "driver upgrade on Friday"}, follow=True)
    assert "box1 is draining: No new bookings" in answer.content.decode()
    server.refresh_from_db()
    assert server.draining and server.drain_reason == "driver upgrade on Friday"
    entry = AuditEntry.objects.get(action="server.drain")
    assert entry.actor == admin_user
    assert entry.message == "admin drained box1: driver upgrade on Friday (1 booking(s) on it go on)"
    assert (
        client.post(drain, {"draining": "on"}, follow=True).content.decode().count("was draining already")
        == 1
    )
    answer = client.post(drain, {"draining": "off"}, follow=True)
    assert "box1 is back in service" in answer.content.decode()
    server.refresh_from_db()
    assert not server.draining and server.drain_reason == ""
    assert AuditEntry.objects.filter(action="server.drain").count() == 2


def test_members_and_leaders_may_not_drain(box, alice, leader):
    for who in (alice, leader):
        assert (
            client_for(who).post(reverse("server_drain", args=["box1"]), {"draining": "on"}).status_code
            == 403
        )
        page = client_for(who).get(reverse("server_timeline", args=["box1"])).content.decode()
        assert "Drain box1" not in page
    with pytest.raises(Forbidden):
        server_drain_set(actor=leader, server=box[0].server, draining=True)
    assert not Server.objects.get(name="box1").draining


def test_the_booking_form_says_why_a_draining_server_is_not_offered(admin_user, box, alice):
    server_drain_set(actor=admin_user, server=box[0].server, draining=True, reason="driver upgrade")
    page = client_for(alice).get(reverse("reservation_new")).content.decode()
    assert (
        "Not offered: box1 (driver upgrade). It is draining: an admin stopped new bookings and jobs there"
        in page
    )
    assert f'value="{box[0].uuid}"' not in page
    timeline = client_for(alice).get(reverse("server_timeline", args=["box1"])).content.decode()
    assert "box1 is draining (driver upgrade)" in timeline


def test_a_drain_reason_with_a_nul_says_why_and_the_service_refuses_it_too(admin_user, box):
    client = client_for(admin_user)
    answer = client.post(
        reverse("server_drain", args=["box1"]), {"draining": "on", "reason": "a\x00b"}, follow=True
    )
    said = " ".join(str(m) for m in answer.context["messages"])
    assert "box1 was not changed: The reason holds a NUL character" in said, said
    with pytest.raises(Invalid, match="NUL"):
        server_drain_set(actor=admin_user, server=box[0].server, draining=True, reason="a\x00b")
    assert not Server.objects.get(name="box1").draining and not AuditEntry.objects.exists()
    html = client.get(reverse("server_timeline", args=["box1"])).content.decode()
    assert 'name="reason" maxlength="200"' in html  # the column's length, from the form's source
