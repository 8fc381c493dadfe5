"""A fresh demo is quiet: the simulated inventory, read as `make run` reads it, for many rounds.

Each round is what a GPU host's worker and the portal's collector do: the backend `get_backend`
opens for GPU_BACKEND=simulated takes a snapshot, the collector ingests it, and the host's
watchdog judges it under the strictest policy (stop at once), so any verdict would show as a
Violation row and a notification. The invented processes are few, marked simulated (no
session), never on a card booked now or soon, and never a violation. And the Violations list
says "Warned" only where the warning reached someone.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse
from django.utils import timezone

from gpus.backends import get_backend
from gpus.booking import reservation_create
from gpus.inventory import Snapshot
from gpus.models import GPU, GPUProcess, Violation, WatchdogPolicy
from gpus.procinfo import describe_process
from gpus.services import servers_report_ingest
from gpus.simulated.backend import MAX_INVENTED_PER_SERVER, SimulatedBackend
from gpus.simulated.inventory import server_names
from jobs.host.watchdog import HostWatchdog
from portal.models import Notification
from portal.services import demo_data_seed
from tests.factories import make_snapshot

ROUNDS = 150
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]

pytestmark = pytest.mark.django_db


@pytest.fixture
def demo(settings, tmp_path) -> dict[str, tuple[SimulatedBackend, HostWatchdog]]:
    """A fresh demo: its seeded users, and each simulated server's backend and watchdog."""
    settings.SIMULATED_PROCESSES_FILE = tmp_path / "simulated-gpu-processes.json"
    settings.SIMULATED_INVENTORY = ""
    demo_data_seed(password="gpu-lab-demo")
    for kind in Violation.Kind.values:
        action = "warn" if kind == Violation.Kind.OWNER_OUTSIDE_JOB else "stop"
        WatchdogPolicy.objects.create(kind=kind, action=action, grace_seconds=0)
    return {
        name: (get_backend("simulated", name), HostWatchdog(name, simulated=True)) for name in server_names()
    }


def run_round(demo: dict[str, tuple[SimulatedBackend, HostWatchdog]]) -> dict[str, Snapshot]:
    snapshots = {name: backend.snapshot() for name, (backend, _) in demo.items()}
    servers_report_ingest(snapshots=list(snapshots.values()))
    for name, (_, watchdog) in demo.items():
        watchdog.round(snapshots[name])
    return snapshots


def invented(snapshot: Snapshot) -> dict[str, int]:
    """The invented processes by card: the simulation's, of no session (real ones have one)."""
    found = {g.uuid: sum(p.session_id is None for p in g.processes or ()) for g in snapshot.gpus}
    return {uuid: n for uuid, n in found.items() if n}


def test_a_fresh_demo_records_no_violation_and_invents_few_processes(demo) -> None:
    seen = listed = 0
    for _ in range(ROUNDS):
        snapshots = run_round(demo)
        per_server = [sum(invented(s).values()) for s in snapshots.values()]
        assert all(n <= MAX_INVENTED_PER_SERVER for n in per_server)
        assert sum(per_server) <= 2  # the shipped inventory's two servers
        seen += sum(per_server)
        # What the dashboard lists: the invented processes, of no session (its "simulated" badge).
        shown = GPUProcess.objects.filter(gpu__server__simulated=True)
        assert shown.count() == sum(per_server) and not shown.exclude(session_id=None).exists()
        listed += shown.count()

    assert seen and listed == seen  # scenery there was: the quiet is not an empty inventory's
    assert Violation.objects.count() == 0
    assert Notification.objects.count() == 0


def test_a_card_just_booked_is_clean_at_the_next_round(demo) -> None:
    alice = get_user_model().objects.get(username="alice")
    busy: dict[str, int] = {}
    for _ in range(ROUNDS):  # until some card runs an invented process
        busy = {uuid: n for s in run_round(demo).values() for uuid, n in invented(s).items()}
        if busy:
            break
    (card,) = list(busy)[:1]
    gpu = GPU.objects.get(uuid=card)
    reservation_create(user=alice, gpus=[card])

    for _ in range(40):
        snapshot = run_round(demo)[gpu.server.name]
        assert card not in invented(snapshot)

    assert not GPUProcess.objects.filter(gpu_id=card).exists()
    assert Violation.objects.count() == 0 and Notification.objects.count() == 0


def test_a_card_booked_for_soon_gets_no_invented_process(demo) -> None:
    alice = get_user_model().objects.get(username="alice")
    run_round(demo)  # the cards have their rows
    start = timezone.now() + timedelta(minutes=10)
    cards = list(
        GPU.objects.filter(server__name="sim-rtx-4x24").order_by("index").values_list("uuid", flat=True)
    )
    # Every card of the server but one, from 10 minutes on: the last one is the only place left.
    reservation_create(user=alice, gpus=cards[:3], start=start, end=start + timedelta(hours=2))

    places = set()
    for _ in range(ROUNDS):
        places |= set(invented(run_round(demo)["sim-rtx-4x24"]))

    assert places <= {cards[3]}
    assert Violation.objects.count() == 0


# --- "Warned" only where a warning went ------------------------------------------------------------


def row_action(html: str, violation: Violation) -> str:
    row = re.search(rf'<tr data-violation="{violation.pk}">(.*?)</tr>', html, re.S).group(1)
    return re.sub(r"<[^>]+>", "", re.findall(r"<td>(.*?)</td>", row, re.S)[-1]).strip()


def test_warned_shows_only_where_someone_was_told(client, admin_user, bob, box, procs) -> None:
    WatchdogPolicy.objects.create(kind="unbooked", action="warn", grace_seconds=0)
    proc = subprocess.Popen(SLEEP, start_new_session=True)
    procs.append(proc)
    mine = replace(describe_process(proc.pid, 2048), username="bob")
    ghost = replace(mine, username="nobody-the-portal-knows")
    snapshot = make_snapshot("box1", gpus=4, processes=0)
    cards = list(snapshot.gpus)
    cards[1], cards[2] = replace(cards[1], processes=(mine,)), replace(cards[2], processes=(ghost,))

    HostWatchdog("box1", simulated=False).round(replace(snapshot, gpus=tuple(cards)), now=timezone.now())
    told = Violation.objects.get(gpu_id=box[1].uuid)
    untold = Violation.objects.get(gpu_id=box[2].uuid)
    client.force_login(admin_user)
    html = client.get(reverse("violations")).content.decode()

    assert (told.action, untold.action) == ("warned", "warned")  # the policy, applied to both
    assert list(Notification.objects.values_list("user__username", flat=True)) == ["bob"]
    assert row_action(html, told) == "Warned"
    assert row_action(html, untold) == "Recorded: nobody to tell"
