"""SimulatedBackend and its YAML inventory; no database needed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from django.db import OperationalError

from gpus.simulated import backend
from gpus.simulated.backend import MAX_INVENTED_PER_SERVER, SimulatedBackend
from gpus.simulated.inventory import DEFAULT_INVENTORY, InventoryError, load_inventory, server_names
from tests.conftest import ROOT

VALID = {
    "users": ["alice", "bob"],
    "servers": [
        {
            "name": "sim-mixed",
            "cpu_count": 16,
            "ram_gb": 64,
            "driver_version": "550.90.07",
            "cuda_version": "12.4",
            "gpus": [
                {"model": "NVIDIA RTX A5000", "count": 1, "memory_gb": 24, "power_limit_w": 230},
                {"model": "NVIDIA RTX A6000", "count": 2, "memory_gb": 48, "power_limit_w": 300},
            ],
        }
    ],
}


@pytest.fixture(autouse=True)
def _nothing_booked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bookings come from the database (tests/test_demo_quiet.py): here, none."""
    monkeypatch.setattr(backend, "booked_cards", lambda server: frozenset())


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_it_loads_the_default_inventory() -> None:
    servers = {s.name: s for s in load_inventory()}

    assert list(servers) == server_names() == ["sim-rtx-4x24", "sim-h100-8x80"]
    rtx = SimulatedBackend("sim-rtx-4x24", seed=1).snapshot()
    h100 = SimulatedBackend("sim-h100-8x80", seed=1).snapshot()
    assert rtx.host.simulated and h100.host.simulated
    assert [g.memory_total_mb for g in rtx.gpus] == [24 * 1024] * 4
    assert [g.memory_total_mb for g in h100.gpus] == [80 * 1024] * 8
    assert {g.name for g in h100.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {g.power_limit_w for g in h100.gpus} == {700.0}
    assert (rtx.host.driver_version, rtx.host.cuda_version, rtx.host.ram_mb) == (
        "550.90.07",
        "12.4",
        256 * 1024,
    )


def test_it_keeps_card_identity_stable_across_instances() -> None:
    first = SimulatedBackend("sim-h100-8x80", seed=1).snapshot().gpus
    second = SimulatedBackend("sim-h100-8x80", seed=2).snapshot().gpus
    other = SimulatedBackend("sim-rtx-4x24", seed=1).snapshot().gpus

    def identity(gpus: tuple) -> list[tuple]:
        return [(g.uuid, g.index, g.pci_bus_id, g.memory_reserved_mb) for g in gpus]

    assert identity(first) == identity(second)
    assert len({g.uuid for g in first + other}) == 12
    assert all(re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", g.uuid) for g in first)
    assert [g.index for g in first] == list(range(8))
    assert [g.pci_bus_id for g in first] == sorted(g.pci_bus_id for g in first)
    assert all(re.fullmatch(r"00000000:[0-9A-F]{2}:00\.0", g.pci_bus_id) for g in first)
    assert all(0.01 <= g.memory_reserved_mb / g.memory_total_mb <= 0.02 for g in first)


def test_it_is_deterministic_given_a_seed() -> None:
    one = SimulatedBackend("sim-h100-8x80", seed=7)
    two = SimulatedBackend("sim-h100-8x80", seed=7)

    assert [one.snapshot() for _ in range(5)] == [two.snapshot() for _ in range(5)]


def test_it_moves_values_between_snapshots_within_range() -> None:
    backend = SimulatedBackend("sim-h100-8x80", seed=3)
    snapshots = [backend.snapshot() for _ in range(300)]

    for snapshot in snapshots:
        for gpu in snapshot.gpus:
            assert 0 <= gpu.utilization_pct <= 100
            assert 0 <= gpu.memory_used_mb <= gpu.memory_total_mb - gpu.memory_reserved_mb
            assert 25 <= gpu.temperature_c <= 90
            assert 0 < gpu.power_w <= gpu.power_limit_w
            assert sum(p.used_memory_mb for p in gpu.processes) <= gpu.memory_used_mb
            assert len(gpu.processes) <= 2
    series = [[g.utilization_pct for g in s.gpus] for s in snapshots]
    assert len({tuple(row) for row in series}) > 1
    power = [[g.power_w for g in s.gpus] for s in snapshots]
    assert power[0] != power[1]


def test_it_runs_busy_and_idle_cards_plausibly() -> None:
    backend = SimulatedBackend("sim-h100-8x80", seed=3)
    idle_for = [0] * 8
    settled, busy = [], []
    for _ in range(300):
        for gpu in backend.snapshot().gpus:
            idle_for[gpu.index] = 0 if gpu.processes else idle_for[gpu.index] + 1
            if idle_for[gpu.index] >= 10:  # long enough for the card to cool down
                settled.append(gpu)
            elif gpu.processes:
                busy.append(gpu)

    assert settled and busy
    for gpu in settled:
        assert gpu.utilization_pct == 0
        assert 250 <= gpu.memory_used_mb <= 600
        assert gpu.temperature_c <= 40
        assert gpu.power_w <= 80
    hot = [g for g in busy if g.utilization_pct >= 90]
    assert hot and all(g.temperature_c >= 65 and g.power_w >= 500 for g in hot)
    assert {p.username for g in busy for p in g.processes} <= {"alice", "bob", "charlie", "dana", "emil"}
    assert all(p.command.startswith("python") and p.pid > 1 for g in busy for p in g.processes)


def test_it_names_the_known_servers_for_an_unknown_one() -> None:
    with pytest.raises(ValueError, match="sim-rtx-4x24, sim-h100-8x80"):
        SimulatedBackend("nope")


def test_it_reads_another_inventory_file(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)

    snapshot = SimulatedBackend("sim-mixed", path, seed=1).snapshot()

    assert server_names(path) == ["sim-mixed"]
    assert snapshot.host.hostname == "sim-mixed"  # defaults to the name
    assert [g.name for g in snapshot.gpus] == ["NVIDIA RTX A5000", "NVIDIA RTX A6000", "NVIDIA RTX A6000"]
    assert all(g.mig_mode is None for g in snapshot.gpus)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d["servers"][0]["gpus"][1].update(memory_gb="lots"), "servers[0].gpus[1].memory_gb"),
        (lambda d: d["servers"][0]["gpus"][0].update(count=0), "servers[0].gpus[0].count"),
        (lambda d: d["servers"][0]["gpus"][0].update(count=True), "servers[0].gpus[0].count"),
        (lambda d: d["servers"][0]["gpus"][0].update(memory_gib=24), "servers[0].gpus[0].memory_gib"),
        (lambda d: d["servers"][0]["gpus"][0].update(mig_mode="on"), "servers[0].gpus[0].mig_mode"),
        (lambda d: d["servers"][0].update(cuda_version=12.4), "servers[0].cuda_version"),
        (lambda d: d["servers"][0].pop("cpu_count"), "servers[0].cpu_count"),
        (lambda d: d["servers"][0].update(name="has space"), "servers[0].name"),
        (lambda d: d["servers"][0].update(gpus=[]), "servers[0].gpus"),
        (lambda d: d["servers"].append(dict(d["servers"][0])), "servers[1].name"),
        (lambda d: d.update(users=[]), "users"),
        (lambda d: d.update(servers={"name": "x"}), "servers"),
    ],
)
def test_it_names_the_bad_field(tmp_path: Path, change, field: str) -> None:
    data = yaml.safe_load(yaml.safe_dump(VALID))  # a deep copy
    change(data)
    path = write(tmp_path, data)

    with pytest.raises(InventoryError, match=re.escape(f"{path}: {field}:")):
        load_inventory(path)


def test_it_rejects_a_file_that_is_not_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "servers: [unclosed\n")

    with pytest.raises(InventoryError, match="not valid YAML"):
        load_inventory(path)


def test_it_ships_the_inventory_beside_the_module() -> None:
    assert DEFAULT_INVENTORY.name == "simulated_inventory.yaml"
    assert DEFAULT_INVENTORY.is_file()


# --- which portal's jobs show: PORTAL_INSTANCE_ID -----------------------------------------------


def _instance_id(**env: str) -> str:
    """PORTAL_INSTANCE_ID as a portal started with `env` (and nothing else of ours) reads it."""
    ours = ("DATABASE_URL", "PORTAL_VAR_DIR", "PORTAL_INSTANCE_ID")
    clean = {name: value for name, value in os.environ.items() if name not in ours}
    read = "from portal import settings; print(settings.PORTAL_INSTANCE_ID)"
    done = subprocess.run(
        [sys.executable, "-c", read],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_one_database_is_one_portal(tmp_path: Path) -> None:
    """Two checkouts with their own databases are two portals, whose jobs the simulated backend
    tells apart; two sharing one database are one portal."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    own_a, own_b = _instance_id(PORTAL_VAR_DIR=a), _instance_id(PORTAL_VAR_DIR=b)
    assert own_a != own_b and own_a == _instance_id(PORTAL_VAR_DIR=a)  # stable across restarts
    shared = f"sqlite:///{tmp_path / 'shared.sqlite3'}"
    assert _instance_id(PORTAL_VAR_DIR=a, DATABASE_URL=shared) == _instance_id(
        PORTAL_VAR_DIR=b, DATABASE_URL=shared
    )
    # Where the database is, not who logs in: a new password is the same portal.
    lab = _instance_id(PORTAL_VAR_DIR=a, DATABASE_URL="postgres://portal:old@db.lab:5432/portal")
    assert lab == _instance_id(PORTAL_VAR_DIR=b, DATABASE_URL="postgres://portal:new@db.lab:5432/portal")
    assert lab != _instance_id(PORTAL_VAR_DIR=a, DATABASE_URL="postgres://portal:old@db.lab:5432/staging")
    assert _instance_id(PORTAL_VAR_DIR=a, PORTAL_INSTANCE_ID="lab-portal") == "lab-portal"


# --- the bookings: where nothing is invented ---------------------------------------------------


def test_it_invents_one_process_a_server_at_most_and_never_on_a_booked_card() -> None:
    booked: set[str] = set()
    backend = SimulatedBackend("sim-h100-8x80", seed=5, booked=lambda: booked)
    places = set()
    for i in range(300):
        if i == 100:  # every card but the last, booked
            booked = {g.uuid for g in backend.snapshot().gpus[:-1]}
        snapshot = backend.snapshot()
        busy = [g.uuid for g in snapshot.gpus if g.processes]
        assert len(busy) <= MAX_INVENTED_PER_SERVER
        assert not set(busy) & booked
        places |= set(busy)

    assert len(places) > 1  # it moves around, off the booked cards once they are booked


@pytest.mark.django_db(transaction=True)  # the backend closes broken connections (a real database call)
def test_a_database_away_costs_the_simulation_nothing(caplog: pytest.LogCaptureFixture) -> None:
    def away() -> set[str]:
        raise OperationalError("database is locked")

    backend = SimulatedBackend("sim-rtx-4x24", seed=1, booked=away)
    snapshots = [backend.snapshot() for _ in range(5)]

    assert all(len(s.gpus) == 4 for s in snapshots)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "cannot read the bookings" in caplog.records[0].message
