"""A SIMULATED GPU backend for hosts without an NVIDIA driver (development, demos, CI).

Servers come from a YAML inventory (by default ``simulated_inventory.yaml`` beside this
module). Telemetry is a mean-reverting random walk per card: idle cards sit at 0% with a few
hundred MB in use; at most MAX_INVENTED_PER_SERVER card of a server runs an invented process
(scenery: a fresh demo must look lived-in, not crowded), never on a card with a booking now or
soon, and now and then it finishes or another starts. Every report says ``simulated=True``.

Real processes of this machine show on the cards too: this portal's jobs (by the card they booked),
and processes declared with ``manage.py simulate_gpu_process`` (a small JSON file), so the
watchdog can be tried end to end without a GPU.

Card constants (UUID, PCI bus id, reserved memory) derive from server name and index, so
they survive restarts; the walk itself is deterministic only when a ``seed`` is given.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import random
import re
import tempfile
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import yaml
from django.conf import settings
from django.db import DatabaseError, close_old_connections
from django.utils import timezone

from gpus.inventory import GPUInfo, HostInfo, ProcessInfo, Snapshot
from gpus.models import Allocation
from gpus.procinfo import describe_process, is_process_pid

log = logging.getLogger(__name__)

DEFAULT_INVENTORY = Path(__file__).with_name("simulated_inventory.yaml")

MAX_GPUS_PER_SERVER = 64
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


class InventoryError(ValueError):
    """The simulated inventory file is malformed; the message names the bad field."""


@dataclass(frozen=True)
class SimulatedGPUSpec:
    model: str
    count: int
    memory_gb: float
    power_limit_w: float
    mig_mode: str | None = None  # "enabled", "disabled", or None: the card has no MIG


@dataclass(frozen=True)
class SimulatedServer:
    name: str
    hostname: str
    cpu_count: int
    ram_gb: float
    driver_version: str
    cuda_version: str
    users: tuple[str, ...]
    gpus: tuple[SimulatedGPUSpec, ...]


# --- loading and validation -------------------------------------------------------------

_MISSING = object()
_SLUG = re.compile(r"^[-a-zA-Z0-9_]+$")


def _is_text(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_positive_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _is_user_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_text(u) for u in value)


def _mapping(value: object, where: str, fields: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InventoryError(f"{where or 'top level'}: expected a mapping, got {value!r}")
    unknown = sorted(set(value) - fields)
    if unknown:
        prefix = f"{where}." if where else ""
        raise InventoryError(f"{prefix}{unknown[0]}: unknown field (known: {', '.join(sorted(fields))})")
    return value


def _field(
    data: dict[str, Any],
    key: str,
    where: str,
    check: Callable[[object], bool],
    expected: str,
    default: Any = _MISSING,
) -> Any:
    name = f"{where}.{key}" if where else key
    if key not in data:
        if default is _MISSING:
            raise InventoryError(f"{name}: missing, expected {expected}")
        return default
    if not check(data[key]):
        raise InventoryError(f"{name}: expected {expected}, got {data[key]!r}")
    return data[key]


def _gpu_spec(data: object, where: str) -> SimulatedGPUSpec:
    data = _mapping(data, where, {"model", "count", "memory_gb", "power_limit_w", "mig_mode"})
    return SimulatedGPUSpec(
        model=_field(data, "model", where, _is_text, "a model name"),
        count=_field(data, "count", where, _is_positive_int, "a positive integer"),
        memory_gb=_field(data, "memory_gb", where, _is_positive_number, "a positive number"),
        power_limit_w=_field(data, "power_limit_w", where, _is_positive_number, "a positive number"),
        mig_mode=_field(
            data,
            "mig_mode",
            where,
            lambda v: v in (None, "enabled", "disabled"),
            "enabled, disabled or null",
            default=None,
        ),
    )


def _server(data: object, where: str, users: tuple[str, ...]) -> SimulatedServer:
    fields = {"name", "hostname", "cpu_count", "ram_gb", "driver_version", "cuda_version"}
    data = _mapping(data, where, fields | {"users", "gpus"})
    version = "a quoted string such as '12.4'"  # unquoted 12.4 is a YAML float
    name = _field(
        data,
        "name",
        where,
        lambda v: isinstance(v, str) and bool(_SLUG.match(v)),
        "a slug (letters, digits, - and _)",
    )
    specs = _field(data, "gpus", where, lambda v: isinstance(v, list) and bool(v), "a list")
    gpus = tuple(_gpu_spec(spec, f"{where}.gpus[{i}]") for i, spec in enumerate(specs))
    if sum(g.count for g in gpus) > MAX_GPUS_PER_SERVER:
        raise InventoryError(f"{where}.gpus: more than {MAX_GPUS_PER_SERVER} GPUs in one server")
    return SimulatedServer(
        name=name,
        hostname=_field(data, "hostname", where, _is_text, "a host name", default=name),
        cpu_count=_field(data, "cpu_count", where, _is_positive_int, "a positive integer"),
        ram_gb=_field(data, "ram_gb", where, _is_positive_number, "a positive number"),
        driver_version=_field(data, "driver_version", where, _is_text, version),
        cuda_version=_field(data, "cuda_version", where, _is_text, version),
        users=tuple(_field(data, "users", where, _is_user_list, "a list of user names", default=users)),
        gpus=gpus,
    )


def load_inventory(path: Path | None = None) -> list[SimulatedServer]:
    """Read and validate an inventory; InventoryError names the file and the bad field."""
    path = path or DEFAULT_INVENTORY
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        data = _mapping(data, "", {"users", "servers"})
        users = tuple(_field(data, "users", "", _is_user_list, "a list of user names"))
        raw = _field(data, "servers", "", lambda v: isinstance(v, list) and bool(v), "a list of servers")
        servers = [_server(s, f"servers[{i}]", users) for i, s in enumerate(raw)]
        names = [s.name for s in servers]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise InventoryError(f"servers[{i}].name: duplicate server name {name!r}")
    except yaml.YAMLError as exc:
        raise InventoryError(f"{path}: not valid YAML: {exc}") from exc
    except InventoryError as exc:
        raise InventoryError(f"{path}: {exc}") from None
    return servers


def server_names(path: Path | None = None) -> list[str]:
    return [s.name for s in load_inventory(path)]


# --- the simulation -----------------------------------------------------------------------


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


def local_job_processes(server: str, instance: str) -> dict[str, list[ProcessInfo]]:
    """This portal's job processes on this machine for simulated `server`, by booked card UUID.

    The simulation stands in for the driver's knowledge of which card a process uses: it takes
    it from the job's environment (PORTAL_SERVER, CUDA_VISIBLE_DEVICES), which the worker wrote.
    Only processes that also carry this portal's PORTAL_INSTANCE count: another checkout on this
    machine runs jobs on the same simulated server names, and they are not this portal's to
    show, nor its watchdog's to stop. What the process is, and which job it belongs to, comes
    from `describe_process` and the session id, exactly as with NVML; a job's own
    PORTAL_JOB_ID is never read.
    """
    found: dict[str, list[ProcessInfo]] = {}
    for proc in psutil.process_iter():
        try:
            if not is_process_pid(proc.pid) or os.getsid(proc.pid) != proc.pid:
                continue  # the job's session leader stands for the job; never pid 0 or init
            env = proc.environ()
            if env.get("PORTAL_SERVER") != server or env.get("PORTAL_INSTANCE") != instance:
                continue
            cards = [u for u in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if u]
            # Spread over its cards, so the job's sum over cards is its real footprint.
            used_mb = proc.memory_info().rss // (1024 * 1024) // max(1, len(cards))
        except (psutil.Error, OSError):
            continue  # exited meanwhile, or another user's (JOB_USER): the simulation cannot see it
        info = describe_process(proc.pid, used_mb)
        for card in cards:
            found.setdefault(card, []).append(info)
    return found


def booked_cards(server: str, now: datetime | None = None) -> frozenset[str]:
    """UUIDs of `server`'s cards with a live allocation (whole or a share) between `now` and
    BOOKED_LOOKAHEAD_SECONDS later: where the simulation invents no process. One query."""
    now = now or timezone.now()
    ahead = now + timedelta(seconds=BOOKED_LOOKAHEAD_SECONDS)
    rows = Allocation.objects.live_between(now, ahead).filter(gpu__server__name=server)
    return frozenset(rows.values_list("gpu_id", flat=True))


# --- processes declared with `manage.py simulate_gpu_process` -----------------------------

# A live process whose start differs from the declared one by more than this is another process
# that reuses the pid (after a reboot, pids count from 1 again): it was never declared, and the
# watchdog must not stop it. The slack absorbs clock adjustments, which move the start times
# psutil derives from the boot time.
START_TIME_SLACK_SECONDS = 1.0


class DeclarationsError(ValueError):
    """The declarations file is malformed; the message names the file and the bad field."""


@dataclass(frozen=True)
class DeclaredProcess:
    gpu: str  # the simulated card's UUID
    pid: int
    started: float  # psutil's create_time: tells the process from a later one with its pid
    memory_mb: int

    def is_running(self) -> bool:
        started = process_started(self.pid)
        return started is not None and abs(started - self.started) <= START_TIME_SLACK_SECONDS


def process_started(pid: int) -> float | None:
    """When live process `pid` of this machine started; None when there is none."""
    if pid <= 0:
        return None  # not a process: to os.kill, 0 and -1 mean whole groups of them
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None  # exited, not reaped yet: it holds no memory and cannot be stopped
        return proc.create_time()
    except (psutil.Error, OverflowError, ValueError):
        return None


def declared_processes(path: Path) -> list[DeclaredProcess]:
    """Every declaration in `path`, exited processes included; none when there is no file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    try:
        data = _mapping(json.loads(text), "", {"processes"})
        raw = _field(data, "processes", "", lambda v: isinstance(v, list), "a list")
        return [_declared(entry, f"processes[{i}]") for i, entry in enumerate(raw)]
    except json.JSONDecodeError as exc:
        raise DeclarationsError(f"{path}: not valid JSON: {exc}") from None
    except InventoryError as exc:
        raise DeclarationsError(f"{path}: {exc}") from None


def _declared(data: object, where: str) -> DeclaredProcess:
    data = _mapping(data, where, {"gpu", "pid", "started", "memory_mb"})
    return DeclaredProcess(
        gpu=_field(data, "gpu", where, _is_text, "a card UUID"),
        pid=_field(data, "pid", where, _is_positive_int, "a positive integer"),
        started=float(_field(data, "started", where, _is_positive_number, "a start time")),
        memory_mb=_field(data, "memory_mb", where, _is_positive_int, "a positive integer"),
    )


def simulated_process_declare(*, path: Path, gpu: str, pid: int, memory_mb: int) -> DeclaredProcess | None:
    """Declare that live process `pid` uses `memory_mb` on simulated card `gpu`.

    Returns the declaration this one replaces (the same pid on the same card), or None.
    Raises ProcessLookupError when `pid` is no live process of this machine.
    """
    started = process_started(pid)
    if started is None:
        raise ProcessLookupError(pid)
    new = DeclaredProcess(gpu=gpu, pid=pid, started=started, memory_mb=memory_mb)
    with _declarations_edit(path) as declared:
        previous = next((d for d in declared if (d.gpu, d.pid) == (gpu, pid)), None)
        if previous is None:
            declared.append(new)
        else:
            declared[declared.index(previous)] = new
    return previous


def simulated_process_remove(*, path: Path, pid: int, gpu: str | None = None) -> list[DeclaredProcess]:
    """Take back `pid`'s declarations (on card `gpu` only, when given); returns those removed."""
    with _declarations_edit(path) as declared:
        removed = [d for d in declared if d.pid == pid and gpu in (None, d.gpu)]
        declared[:] = [d for d in declared if d not in removed]
    return removed


@contextlib.contextmanager
def _declarations_edit(path: Path) -> Iterator[list[DeclaredProcess]]:
    """The declarations of running processes, to change in place; written back on exit.

    Read, change and write happen under one exclusive lock, so two commands at once never lose
    each other's entries. The lock is a file of its own: every write replaces the data file
    with a new inode, and a lock on the old one would guard nothing.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        declared = [d for d in declared_processes(path) if d.is_running()]
        yield declared
        _declarations_write(path, declared)


def _declarations_write(path: Path, declared: list[DeclaredProcess]) -> None:
    # A temporary file renamed over the old one: a worker reads the old list or the new one,
    # never half of one.
    text = json.dumps({"processes": [asdict(d) for d in declared]}, indent=2) + "\n"
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


class _DeclarationsFile:
    """The declarations file as a worker reads it, every snapshot: parsed again only when it
    changed. No file means no declarations; a malformed one counts as empty, logged once per
    version of it, so a typo never costs the server its telemetry."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._version: tuple[int, int, int] | None = None
        self._declared: list[DeclaredProcess] = []

    def running(self) -> list[DeclaredProcess]:
        if self.path is None:
            return []
        try:
            stat = self.path.stat()
            # Every write is a new inode (os.replace), so an edit that keeps the size within
            # the clock's granularity still reads as a change.
            version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except OSError:
            version = None  # no file yet
        if version != self._version:
            self._version = version
            self._declared = self._read(self.path) if version else []
        return [d for d in self._declared if d.is_running()]

    @staticmethod
    def _read(path: Path) -> list[DeclaredProcess]:
        try:
            return declared_processes(path)
        except (DeclarationsError, OSError) as exc:
            log.warning("Ignoring the simulated GPU processes until the file changes: %s", exc)
            return []


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
        self._declarations = _DeclarationsFile(processes_file)
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
