from datetime import timedelta

import pytest
from django.db.models.functions import Now
from django.utils import timezone

from gpus.models import GPU, GPUProcess, Server, TelemetrySample
from gpus.services import server_report_ingest, servers_report_ingest, telemetry_prune
from tests.factories import make_snapshot

pytestmark = pytest.mark.django_db


def test_it_registers_a_server_and_its_gpus_on_first_report():
    server = server_report_ingest(snapshot=make_snapshot("box1", gpus=4, processes=2))
    assert server.name == "box1"
    assert server.status == Server.Status.ONLINE
    assert server.queue == "host.box1"
    assert GPU.objects.filter(server=server).count() == 4
    assert GPUProcess.objects.filter(gpu__server=server).count() == 8
    gpu = GPU.objects.get(uuid="GPU-box1-02")
    assert (gpu.index, gpu.memory_total_mb, gpu.temperature_c) == (2, 24 * 1024, 42)


def test_it_updates_in_place_and_replaces_processes():
    server_report_ingest(snapshot=make_snapshot("box1", gpus=2, util=10, processes=2))
    server_report_ingest(snapshot=make_snapshot("box1", gpus=2, util=95, processes=0))
    assert Server.objects.count() == 1
    assert list(GPU.objects.values_list("utilization_pct", flat=True)) == [95, 95]
    assert GPUProcess.objects.count() == 0


def test_it_keeps_na_metrics_as_null():
    from dataclasses import replace

    snap = make_snapshot("box1", gpus=1)
    card = replace(snap.gpus[0], power_w=None, temperature_c=None, utilization_pct=None)
    server_report_ingest(snapshot=replace(snap, gpus=(card,)))
    gpu = GPU.objects.get()
    assert gpu.power_w is None and gpu.temperature_c is None and gpu.utilization_pct is None


def test_it_computes_bookable_memory(settings):
    settings.GPU_CONTEXT_HEADROOM_MB = 500
    server_report_ingest(snapshot=make_snapshot("box1", gpus=1, memory_gb=24))
    gpu = GPU.objects.get()
    assert gpu.memory_bookable_mb == 24 * 1024 - 300 - 500


def test_it_shows_a_silent_server_offline_and_keeps_draining(settings):
    settings.SERVER_OFFLINE_AFTER_SECONDS = 20
    server = server_report_ingest(snapshot=make_snapshot("box1", gpus=1))
    # 25 s ago by the database's clock, which last_seen and its readers keep (portal.clock)
    Server.objects.filter(pk=server.pk).update(last_seen=Now() - timedelta(seconds=25))
    server.refresh_from_db()
    assert server.status == Server.Status.OFFLINE
    assert not Server.objects.online().exists()
    server = server_report_ingest(snapshot=make_snapshot("box1", gpus=1))
    Server.objects.filter(pk=server.pk).update(draining=True)
    server_report_ingest(snapshot=make_snapshot("box1", gpus=1))
    server.refresh_from_db()
    assert server.status == Server.Status.DRAINING  # a report never clears draining


def test_it_downsamples_history_and_prunes_old_samples(settings):
    settings.TELEMETRY_HISTORY_SECONDS = 15
    settings.TELEMETRY_RETENTION_HOURS = 1
    start = timezone.now() - timedelta(hours=2)
    for second in range(0, 60, 3):  # 20 reports, 3 s apart
        server_report_ingest(snapshot=make_snapshot("box1", gpus=2), now=start + timedelta(seconds=second))
    assert TelemetrySample.objects.count() == 2 * 4  # one per card at 0, 15, 30, 45 s
    server_report_ingest(snapshot=make_snapshot("box1", gpus=2))
    assert telemetry_prune() == 8
    assert TelemetrySample.objects.count() == 2


def test_it_writes_a_round_of_many_hosts_in_a_fixed_number_of_queries():
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def rounds(servers: int, gpus: int) -> tuple[int, int]:
        """The queries of a round whose process lists all changed, then of the same round again."""
        moved = [make_snapshot(f"s{servers}-{s:02d}", gpus=gpus, processes=3) for s in range(servers)]
        steady = [make_snapshot(f"s{servers}-{s:02d}", gpus=gpus, processes=2) for s in range(servers)]
        servers_report_ingest(snapshots=moved)
        with CaptureQueriesContext(connection) as changed:
            servers_report_ingest(snapshots=steady)
        with CaptureQueriesContext(connection) as same:
            servers_report_ingest(snapshots=steady)
        return len(changed), len(same)

    small, large = rounds(1, 1), rounds(64, 8)
    # Bulk statements (gpus/bulk.py), the test's own savepoint around the service, and the jobs
    # app's two receivers' savepoints (a failure there must not cost the round's telemetry):
    # usage's, and the lent cards' watch with its one read (jobs.lending.loans_watch). A round
    # whose process lists did not change writes none (GPU.processes_digest).
    assert large == small, (small, large)
    assert small[1] == small[0] - 2  # no DELETE and no INSERT of processes
    assert small[0] <= (17 if connection.vendor == "postgresql" else 13)
    assert GPU.objects.count() == 1 + 64 * 8
    assert GPUProcess.objects.count() == (1 + 64 * 8) * 2


def test_it_redescribes_a_card_whose_hardware_facts_change():
    from dataclasses import replace

    snap = make_snapshot("box1", gpus=2)
    server_report_ingest(snapshot=snap)
    moved = replace(snap.gpus[1], mig_mode="enabled", index=5)
    server_report_ingest(snapshot=replace(snap, gpus=(snap.gpus[0], moved)))
    gpu = GPU.objects.get(uuid="GPU-box1-01")
    assert (gpu.mig_mode, gpu.index) == ("enabled", 5)
    # The card moves with its UUID when it reappears in another server.
    other = make_snapshot("box2", gpus=0)
    server_report_ingest(snapshot=replace(other, gpus=(moved,)))
    assert GPU.objects.get(uuid="GPU-box1-01").server.name == "box2"


def test_a_process_row_an_admin_deletes_comes_back_with_the_next_round(client, admin_user):
    """A round rewrites only the process lists that changed (GPU.processes_digest): one an admin
    deleted a row of is rewritten whole at the next round, not left short; none is added or
    changed in the admin."""
    from django.urls import reverse

    snapshot = make_snapshot("box1", gpus=1, processes=2)
    server_report_ingest(snapshot=snapshot)
    client.force_login(admin_user)
    gone = GPUProcess.objects.order_by("pid").first()
    answer = client.post(reverse("admin:gpus_gpuprocess_delete", args=[gone.pk]), {"post": "yes"})
    assert answer.status_code == 302 and GPUProcess.objects.count() == 1
    server_report_ingest(snapshot=snapshot)
    assert sorted(GPUProcess.objects.values_list("pid", flat=True)) == [1000, 1001]
    assert client.get(reverse("admin:gpus_gpuprocess_add")).status_code == 403
    page = client.get(reverse("admin:gpus_gpuprocess_change", args=[GPUProcess.objects.first().pk]))
    assert page.status_code == 200 and "Save" not in page.content.decode()  # shown, not changed
