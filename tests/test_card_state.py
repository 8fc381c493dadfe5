"""A card that falls off the bus or stops answering, and a process list that cannot be read."""

from __future__ import annotations

from dataclasses import replace

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.inventory import CardState, GPUInfo
from gpus.models import GPU, GPUProcess
from gpus.services import server_report_ingest
from portal.errors import Conflict
from tests.factories import make_snapshot


def _report(**changes) -> None:
    """box1 reports again, its card 0 changed as given (the way the NVML backend reports it)."""
    snapshot = make_snapshot("box1", gpus=4)
    card: GPUInfo = replace(snapshot.gpus[0], **changes)
    server_report_ingest(snapshot=replace(snapshot, gpus=(card, *snapshot.gpus[1:])))


LOST = {
    "state": CardState.LOST,
    "name": "Unknown GPU",
    "memory_total_mb": 0,
    "memory_reserved_mb": 0,
    "pci_bus_id": "",
    "memory_used_mb": None,
    "utilization_pct": None,
    "processes": None,
}


def test_a_lost_card_keeps_its_hardware_facts(box):
    before = GPU.objects.get(uuid=box[0].uuid)
    _report(**LOST)
    card = GPU.objects.get(uuid=box[0].uuid)
    assert card.state == CardState.LOST and not card.bookable
    assert (card.name, card.memory_total_mb, card.memory_reserved_mb, card.pci_bus_id) == (
        before.name,
        before.memory_total_mb,
        before.memory_reserved_mb,
        before.pci_bus_id,
    )
    assert (card.memory_used_mb, card.utilization_pct, card.processes_known) == (None, None, False)
    assert not GPUProcess.objects.filter(gpu=card).exists()

    _report()  # it answers again
    card.refresh_from_db()
    assert card.state == CardState.OK and card.processes_known


def test_a_lost_card_never_seen_before_is_not_invented(db):
    snapshot = make_snapshot("box1", gpus=2)
    server_report_ingest(
        snapshot=replace(snapshot, gpus=(replace(snapshot.gpus[0], **LOST), snapshot.gpus[1]))
    )
    assert list(GPU.objects.values_list("index", flat=True)) == [1]


@pytest.mark.parametrize(
    ("state", "words"), [(CardState.LOST, "fallen off the bus"), (CardState.UNRESPONSIVE, "did not answer")]
)
def test_a_card_that_is_not_ok_takes_no_booking(alice, box, state, words):
    _report(**{**LOST, "state": state})
    with pytest.raises(Conflict, match=words) as refused:
        reservation_create(user=alice, gpus=[box[0].uuid])
    assert refused.value.field == "gpus"
    picked = reservation_create(user=alice, count=3, server="box1")
    assert box[0].uuid not in set(picked.allocations.values_list("gpu_id", flat=True))


def test_the_dashboard_and_api_show_lost_cards_and_unknown_processes(client, alice, box):
    _report(**LOST)
    client.force_login(alice)
    html = client.get(reverse("dashboard_servers")).content.decode()
    assert 'class="badge card-lost"' in html
    assert ">unknown</span>" in html
    assert f'data-reserve="{box[0].uuid}"' not in html
    assert f'data-reserve="{box[1].uuid}"' in html

    api = APIClient()
    api.force_authenticate(alice)
    row = api.get(f"/api/v1/gpus/{box[0].uuid}/").json()
    assert (row["state"], row["processes_known"], row["processes"]) == ("lost", False, [])
