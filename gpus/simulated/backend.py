"""A SIMULATED GPU backend for hosts without an NVIDIA driver (development, demos, CI): the
random walk of one server's cards, with this machine's real processes shown on them.

Servers come from the YAML inventory (gpus.simulated.inventory). Telemetry is a mean-reverting
random walk per card: idle cards sit at 0% with a few hundred MB in use; at most
MAX_INVENTED_PER_SERVER card of a server runs an invented process (scenery: a fresh demo must
look lived-in, not crowded), never on a card with a booking now or soon, and now and then it
finishes or another starts. Every report says ``simulated=True``.

Real processes of this machine show on the cards too: this portal's jobs (by the card they
booked, gpus.simulated.local_jobs), and processes declared with ``manage.py simulate_gpu_process``
(gpus.simulated.declarations), so the watchdog can be tried end to end without a GPU.

Card constants (UUID, PCI bus id, reserved memory) derive from server name and index, so
they survive restarts; the walk itself is deterministic only when a ``seed`` is given.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError, close_old_connections
from django.utils import timezone

from gpus.inventory import GPUInfo, HostInfo, ProcessInfo, Snapshot
from gpus.models import Allocation
from gpus.procinfo import describe_process, is_process_pid
from gpus.simulated.declarations import DeclarationsFile, DeclaredProcess
from gpus.simulated.inventory import DEFAULT_INVENTORY, SimulatedGPUSpec, load_inventory
from gpus.simulated.local_jobs import local_job_processes

log = logging.getLogger(__name__)

IDLE_TEMPERATURE_C = 35.0
FULL_TEMPERATURE_C = 80.0
IDLE_POWER_W = 60.0
JOB_START_CHANCE = 0.05  # per snapshot, on a server with no invented process
JOB_FINISH_CHANCE = 0.02  # per snapshot, on a busy card
# Invented processes at once on one server (one process each): with the shipped inventory's
# two servers, a fresh demo shows two at most, so the visitor's own work stands out.
MAX_INVENTED_PER_SERVER = 1
# A card booked from now until this far ahead gets no invented process, and loses the one it
# has: the card a visitor just booked is clean at the next snapshot, and stays so.
BOOKED_LOOKAHEAD_SECONDS = 15 * 60

COMMANDS = (
    "python train.py --config configs/resnet50.yaml",
    "python -m torch.distributed.run --nproc-per-node=1 train.py --epochs 90",
    "python finetune.py --model llama-3-8b --lora-rank 16",
    "python eval.py --checkpoint runs/exp42/best.pt",
    "python -u sweep.py --trial 7",
    "python -m ipykernel_launcher -f /run/user/1000/jupyter/kernel-3f2a.json",
)


@dataclass(frozen=True)
class _FakeProcess:
    pid: int
    username: str
    command: str
    memory_share: float  # of the card's used memory


@dataclass
class _Card:
    spec: SimulatedGPUSpec
    index: int
    uuid: str
    pci_bus_id: str
    total_mb: int
    reserved_mb: int
    idle_memory_mb: float
    processes: list[_FakeProcess] = field(default_factory=list)
    target_utilization: float = 0.0
    target_memory_mb: float = 0.0
    utilization: float = 0.0
    memory_mb: float = 0.0
    temperature: float = IDLE_TEMPERATURE_C
    power_w: float = 0.0

    @property
    def usable_mb(self) -> int:
        return self.total_mb - self.reserved_mb

    @property
    def idle_power_w(self) -> float:
        return min(IDLE_POWER_W, self.spec.power_limit_w / 4)


def booked_cards(server: str, now: datetime | None = None) -> frozenset[str]:
    """UUIDs of `server`'s cards with a live allocation (whole or a share) between `now` and
    BOOKED_LOOKAHEAD_SECONDS later: where the simulation invents no process. One query."""
    now = now or timezone.now()
    ahead = now + timedelta(seconds=BOOKED_LOOKAHEAD_SECONDS)
    rows = Allocation.objects.live_between(now, ahead).filter(gpu__server__name=server)
    return frozenset(rows.values_list("gpu_id", flat=True))


def _revert(value: float, target: float, pull: float, noise: float, low: float, high: float) -> float:
    """One step of a mean-reverting walk, clamped to [low, high]."""
    return min(high, max(low, value + pull * (target - value) + noise))


class SimulatedBackend:
    """Reports one server of the simulated inventory, with plausibly moving telemetry."""

    def __init__(
        self,
        server_name: str,
        path: Path | None = None,
        seed: int | None = None,
        processes_file: Path | None = None,
        instance: str | None = None,
        booked: Callable[[], Collection[str]] | None = None,
    ) -> None:
        """`processes_file`: the processes declared with `simulate_gpu_process`; None: none.
        `instance`: the portal whose jobs show on the cards; None: this one (PORTAL_INSTANCE_ID).
        `booked`: the UUIDs of the cards booked now or soon, asked every snapshot; None: this
        portal's bookings (`booked_cards`)."""
        servers = {s.name: s for s in load_inventory(path)}
        if server_name not in servers:
            raise ValueError(
                f"Unknown simulated server {server_name!r} in {path or DEFAULT_INVENTORY}; "
                f"known servers: {', '.join(servers)}"
            )
        self.server = server = servers[server_name]
        self._rng = random.Random(seed)
        self._instance = settings.PORTAL_INSTANCE_ID if instance is None else instance
        self._declarations = DeclarationsFile(processes_file)
        self._booked = booked or (lambda: booked_cards(server_name))
        self._last_booked: frozenset[str] = frozenset()
        self._bookings_away = False
        self.host = HostInfo(
            name=server.name,
            hostname=server.hostname,
            driver_version=server.driver_version,
            cuda_version=server.cuda_version,
            cpu_count=server.cpu_count,
            ram_mb=int(server.ram_gb * 1024),
            simulated=True,
        )
        specs = [spec for spec in server.gpus for _ in range(spec.count)]
        self._cards = [self._card(server.name, i, spec, len(specs)) for i, spec in enumerate(specs)]
        for card in self._cards:
            card.memory_mb = card.idle_memory_mb
            card.temperature = self._target_temperature(card)
            card.power_w = self._power(card)
        self._fresh = True  # the first snapshot sets the scene (opening a backend reads nothing)

    def snapshot(self) -> Snapshot:
        booked = self._booked_now()
        if self._fresh:
            self._fresh = False
            # A lived-in start: one invented process already running, most of the time.
            if self._rng.random() < 0.7 and (card := self._pick_idle(booked)):
                self._start_job(card)
                card.utilization, card.memory_mb = card.target_utilization, card.target_memory_mb
                card.temperature = self._target_temperature(card)
        for card in self._cards:
            if card.processes and card.uuid in booked:
                card.processes = []  # booked meanwhile: the scenery makes way at once
        if self._invented() < MAX_INVENTED_PER_SERVER and self._rng.random() < JOB_START_CHANCE:
            card = self._pick_idle(booked)
            if card is not None:
                self._start_job(card)
        for card in self._cards:
            self._step(card)
        jobs = local_job_processes(self.server.name, self._instance)
        declared = self._declarations.running()
        return Snapshot(
            host=self.host,
            gpus=tuple(self._with_local(self._report(card), jobs, declared) for card in self._cards),
        )

    @staticmethod
    def _with_local(
        report: GPUInfo, jobs: dict[str, list[ProcessInfo]], declared: list[DeclaredProcess]
    ) -> GPUInfo:
        """This machine's real processes on a simulated card, described as NVML's are.

        Portal jobs booked on the card run on the CPU here; they show on the card anyway
        (resident memory as "GPU memory", the card busy) so the demo shows who holds what.
        A declared process holds the memory it was declared with, even a job's process: an
        over-memory job is what such a declaration is for. It leaves the utilization alone.
        """
        # pid <= 1 is never a GPU process (gpus.procinfo.is_process_pid), declared or not.
        mine = [
            describe_process(d.pid, d.memory_mb)
            for d in declared
            if d.gpu == report.uuid and is_process_pid(d.pid)
        ]
        shown = {p.pid for p in mine}
        job_processes = [p for p in jobs.get(report.uuid, ()) if p.pid not in shown]
        local = tuple(job_processes + mine)
        if not local:
            return report
        used = (report.memory_used_mb or 0) + sum(p.used_memory_mb or 0 for p in local)
        utilization = report.utilization_pct
        if job_processes:
            utilization = max(utilization or 0, 90)
        return replace(
            report,
            processes=(report.processes or ()) + local,
            memory_used_mb=min(report.memory_total_mb, used),
            utilization_pct=utilization,
        )

    def close(self) -> None:
        pass  # nothing held

    def _booked_now(self) -> frozenset[str]:
        """The cards booked now or soon. A database away costs the round nothing: nobody can
        book meanwhile, so the cards known booked stay as they were (none, at a first read)."""
        try:
            booked = frozenset(self._booked())
        except DatabaseError as exc:
            close_old_connections()  # a broken connection is opened afresh at the next read
            if not self._bookings_away:  # one line an outage, not one a snapshot
                log.warning("Simulation: cannot read the bookings (%s); it keeps the last known", exc)
            self._bookings_away = True
            return self._last_booked
        self._bookings_away = False
        self._last_booked = booked
        return booked

    def _invented(self) -> int:
        return sum(len(card.processes) for card in self._cards)

    def _pick_idle(self, booked: Collection[str]) -> _Card | None:
        """An idle card nobody has booked now or soon, at random; None when there is none."""
        free = [c for c in self._cards if not c.processes and c.uuid not in booked]
        return self._rng.choice(free) if free else None

    @staticmethod
    def _card(server: str, index: int, spec: SimulatedGPUSpec, count: int) -> _Card:
        card_uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"{server}/{index}")
        constants = random.Random(card_uuid.int)  # the same on every restart
        total_mb = int(spec.memory_gb * 1024)
        # Spread the cards over the PCI buses in index order, as NVML enumerates them.
        bus = 0x18 + index * max(1, 0xE0 // count)
        return _Card(
            spec=spec,
            index=index,
            uuid=f"GPU-{card_uuid}",
            pci_bus_id=f"00000000:{bus:02X}:00.0",
            total_mb=total_mb,
            reserved_mb=int(total_mb * constants.uniform(0.01, 0.02)),
            idle_memory_mb=constants.uniform(250, 600),
        )

    def _start_job(self, card: _Card) -> None:
        rng = self._rng
        card.processes = [
            _FakeProcess(
                pid=rng.randint(2_000, 4_000_000),
                username=rng.choice(self.server.users),
                command=rng.choice(COMMANDS),
                memory_share=1.0,
            )
        ]
        card.target_utilization = rng.uniform(55, 99)
        card.target_memory_mb = card.usable_mb * rng.uniform(0.35, 0.95)

    def _step(self, card: _Card) -> None:
        rng = self._rng
        if card.processes and rng.random() < JOB_FINISH_CHANCE:
            card.processes = []
        if card.processes:
            card.utilization = _revert(
                card.utilization, card.target_utilization, 0.3, rng.gauss(0, 6), 0, 100
            )
            card.memory_mb = _revert(
                card.memory_mb,
                card.target_memory_mb,
                0.5,
                rng.gauss(0, card.usable_mb * 0.005),
                0,
                card.usable_mb,
            )
        else:
            # An exited process frees its memory at once; an idle card reads exactly 0%.
            card.utilization = 0.0 if card.utilization < 2 else card.utilization * 0.3
            card.memory_mb = card.idle_memory_mb
        # Temperature lags behind the load; power follows it at once.
        card.temperature += 0.4 * (self._target_temperature(card) - card.temperature) + rng.gauss(0, 0.4)
        card.power_w = self._power(card)

    @staticmethod
    def _target_temperature(card: _Card) -> float:
        return IDLE_TEMPERATURE_C + (FULL_TEMPERATURE_C - IDLE_TEMPERATURE_C) * card.utilization / 100

    def _power(self, card: _Card) -> float:
        limit, idle = card.spec.power_limit_w, card.idle_power_w
        load = (0.95 * limit - idle) * card.utilization / 100
        # An idle card draws steadily; under load the draw swings with the kernels.
        watts = idle + load + self._rng.gauss(0, 0.005 * limit + 0.02 * load)
        return min(limit, max(idle * 0.8, watts))

    @staticmethod
    def _report(card: _Card) -> GPUInfo:
        used_mb = round(card.memory_mb)
        return GPUInfo(
            uuid=card.uuid,
            index=card.index,
            name=card.spec.model,
            pci_bus_id=card.pci_bus_id,
            memory_total_mb=card.total_mb,
            memory_reserved_mb=card.reserved_mb,
            memory_used_mb=used_mb,
            utilization_pct=round(card.utilization),
            temperature_c=round(card.temperature),
            power_w=round(card.power_w, 1),
            power_limit_w=float(card.spec.power_limit_w),
            mig_mode=card.spec.mig_mode,
            processes=tuple(
                ProcessInfo(
                    pid=p.pid,
                    username=p.username,
                    command=p.command,
                    used_memory_mb=int(used_mb * p.memory_share),
                )
                for p in card.processes
            ),
        )
