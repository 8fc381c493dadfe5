"""GET /api/v1/gpus/ from plain rows (gpus/api_rows.py) says exactly what GPUSerializer says of the
same cards, byte for byte: fields, order, conversions, privacy of command lines and names."""

from __future__ import annotations

from dataclasses import replace

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework import viewsets
from rest_framework.test import APIRequestFactory, force_authenticate

from gpus.api import GPUViewSet
from gpus.booking import reservation_create
from gpus.inventory import CardState, ProcessInfo
from gpus.models import ContainerImage
from gpus.services import servers_report_ingest
from jobs.models import Job
from portal.models import Profile
from tests.factories import make_snapshot

pytestmark = pytest.mark.django_db


class SerializerList(GPUViewSet):
    """The list as DRF gives it: GPUSerializer(many=True) over the prefetched cards."""

    list = viewsets.ReadOnlyModelViewSet.list


def both(user, query: str = "") -> tuple[bytes, bytes]:
    outputs = []
    for view in (GPUViewSet, SerializerList):
        request = APIRequestFactory().get(f"/api/v1/gpus/{query}")
        force_authenticate(request, get_user_model().objects.get(pk=user.pk))
        response = view.as_view({"get": "list"})(request)
        assert response.status_code == 200
        outputs.append(response.render().content)
    return outputs[0], outputs[1]


@pytest.fixture
def lab(alice, bob, charlie):
    """Two servers (one simulated), cards of every state, processes of jobs, a session, alice's own
    account and strangers; bookings by alice and by charlie (an outsider: not named to alice)."""
    Profile.objects.update_or_create(user=alice, defaults={"unix_account": "alice"})
    box1 = make_snapshot("box1", gpus=3, processes=2)
    cards = list(box1.gpus)
    cards[0] = replace(
        cards[0],
        processes=(
            ProcessInfo(4001, "alice", "python train.py --token s3cret", 900, 4001, 1.7e9),
            ProcessInfo(4002, "svc", "/usr/bin/python3 serve.py --key k", None, 4002, None),
            ProcessInfo(4003, "bob", "jupyter lab", 300, 4003, 1.7e9 + 0.25),
        ),
        power_w=None,
        mig_mode="enabled",
    )
    cards[1] = replace(
        cards[1], state=CardState.LOST, memory_used_mb=None, utilization_pct=None, processes=None
    )
    cards[2] = replace(cards[2], power_limit_w=None, temperature_c=None, processes=())
    box1 = replace(box1, gpus=tuple(cards))
    servers_report_ingest(snapshots=[make_snapshot("box1", gpus=3)])
    servers_report_ingest(snapshots=[box1, make_snapshot("box2", gpus=2, processes=1, simulated=True)])
    image = ContainerImage.objects.create(name="tf-2.17", reference="/srv/images/tf")
    booking = reservation_create(user=bob, gpus=["GPU-box1-00"])
    Job.objects.create(
        owner=bob,
        reservation=booking,
        team=booking.team,
        gpu_uuids=["GPU-box1-00"],
        name="train.py",
        not_before=booking.start,
        status=Job.Status.RUNNING,
        pid=4003,
        image=image,
        server=booking.allocations.get().gpu.server,
    )
    reservation_create(user=charlie, gpus=["GPU-box2-01"], memory_mb=4096)
    servers_report_ingest(snapshots=[box1])  # the job's process is attributed by its session


def test_it_lists_what_the_serializer_lists(lab, alice):
    fast, serializer = both(alice)
    assert b"s3cret" in fast and b"--key" not in fast  # alice's own command whole, a stranger's not
    assert b'"state":"lost"' in fast and b'"processes_known":false' in fast
    assert b'"image":"tf-2.17"' in fast and b'"job":"job ' in fast
    assert fast == serializer


def test_it_lists_the_same_for_an_admin_filtered_and_in_another_time_zone(lab, admin_user, alice):
    with timezone.override("Asia/Kolkata"):
        fast, serializer = both(admin_user, "?server=box1")
    assert b"+05:30" in fast and b"--key" in fast
    assert fast == serializer
    assert both(alice, "?server=nowhere") == (b"[]", b"[]")
