"""Real Celery worker processes against the configured Redis and the test database."""

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.models import GPU, Server
from gpus.simulated.inventory import server_names
from portal.celery import app
from tests.waiting import wait_for

pytestmark = [pytest.mark.worker, pytest.mark.django_db(transaction=True)]


def _gpus_of(server: str) -> list[GPU]:
    return list(GPU.objects.filter(server__name=server).order_by("index"))


def test_it_fills_and_updates_the_inventory_from_a_real_worker(start_worker, alice):
    name = server_names()[0]
    start_worker(None)
    start_worker(name)
    wait_for(lambda: len(_gpus_of(name)) >= 4, timeout=60, what=f"{name} to report its GPUs")
    api = APIClient()
    api.force_authenticate(alice)
    first = {g["uuid"]: g["updated_at"] for g in api.get(f"/api/v1/gpus/?server={name}").json()}
    assert first and all(g.startswith("GPU-") for g in first)
    assert all(g["simulated"] for g in api.get("/api/v1/gpus/").json())

    def moved() -> bool:
        now = {g["uuid"]: g["updated_at"] for g in api.get(f"/api/v1/gpus/?server={name}").json()}
        return all(now[uuid] != first[uuid] for uuid in first)

    wait_for(moved, timeout=15, what="a second telemetry round")
    assert Server.objects.get(name=name).status == Server.Status.ONLINE


def test_it_runs_one_worker_per_server_on_its_own_queue(start_worker, settings):
    first, second = server_names()[:2]
    start_worker(None)
    start_worker(first)
    start_worker(second)
    wait_for(lambda: _gpus_of(first) and _gpus_of(second), timeout=60, what="both servers to report")
    assert {g.server.name for g in GPU.objects.select_related("server")} == {first, second}
    assert not set(g.uuid for g in _gpus_of(first)) & set(g.uuid for g in _gpus_of(second))

    def queues() -> dict[str, set[str]]:
        replies = app.control.inspect(
            destination=[f"{first}@test", f"{second}@test"], timeout=2
        ).active_queues()
        return {node: {q["name"] for q in qs} for node, qs in (replies or {}).items()}

    consumed = wait_for(lambda: len(queues()) == 2 and queues(), timeout=20, what="both workers to answer")
    assert consumed == {f"{first}@test": {f"host.{first}"}, f"{second}@test": {f"host.{second}"}}


def test_it_shows_a_stopped_worker_offline(start_worker, settings):
    settings.SERVER_OFFLINE_AFTER_SECONDS = 5
    name = server_names()[0]
    start_worker(None)
    worker = start_worker(name)
    wait_for(lambda: _gpus_of(name), timeout=60, what="the first report")
    worker.kill()  # the host dies: no goodbye message
    worker.wait()
    stopped_at = timezone.now()
    server = wait_for(
        lambda: (server := Server.objects.get(name=name)).status == Server.Status.OFFLINE and server,
        timeout=15,
        what="the server to go offline",
    )
    # Its reports stopped with it (one still on its way at most): offline is its last report aging.
    assert server.last_seen < stopped_at + timedelta(seconds=3)
