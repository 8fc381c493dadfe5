"""A SIMULATED GPU backend for hosts without an NVIDIA driver (development, demos, CI).

Servers come from a YAML inventory (by default ``simulated_inventory.yaml`` beside this
module). Telemetry is a mean-reverting random walk per card: busy cards run one or two
fake processes at high utilisation, idle cards sit at 0% with a few hundred MB in use, and
now and then a job finishes or starts. Every report says ``simulated=True``.

Card constants (UUID, PCI bus id, reserved memory) derive from server name and index, so
they survive restarts; the walk itself is deterministic only when a ``seed`` is given.
"""

from __future__ import annotations

import os
import random
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import yaml

from gpus.inventory import GPUInfo, HostInfo, ProcessInfo, Snapshot

DEFAULT_INVENTORY = Path(__file__).with_name("simulated_inventory.yaml")

MAX_GPUS_PER_SERVER = 64
IDLE_TEMPERATURE_C = 35.0
FULL_TEMPERATURE_C = 80.0
IDLE_POWER_W = 60.0
JOB_START_CHANCE = 0.03  # per snapshot, on an idle card
JOB_FINISH_CHANCE = 0.02  # per snapshot, on a busy card

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


def local_job_processes(server: str) -> dict[str, list[ProcessInfo]]:
    """This machine's portal job processes for simulated `server`, by booked card UUID."""
    found: dict[str, list[ProcessInfo]] = {}
    for proc in psutil.process_iter(["pid", "username", "cmdline"]):
        try:
            env = proc.environ()
            if env.get("PORTAL_SERVER") != server or not env.get("PORTAL_JOB_ID", "").isdigit():
                continue
            if os.getsid(proc.pid) != proc.pid:
                continue  # the job's session leader stands for the job
            cards = [u for u in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if u]
            info = ProcessInfo(
                pid=proc.pid,
                username=proc.info["username"] or "?",
                command=" ".join(proc.info["cmdline"] or ())[:300],
                # Spread over its cards, so the job's sum over cards is its real footprint.
                used_memory_mb=proc.memory_info().rss // (1024 * 1024) // max(1, len(cards)),
                job_id=int(env["PORTAL_JOB_ID"]),
            )
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        for card in cards:
            found.setdefault(card, []).append(info)
    return found


def _revert(value: float, target: float, pull: float, noise: float, low: float, high: float) -> float:
    """One step of a mean-reverting walk, clamped to [low, high]."""
    return min(high, max(low, value + pull * (target - value) + noise))


class SimulatedBackend:
    """Reports one server of the simulated inventory, with plausibly moving telemetry."""

    def __init__(self, server_name: str, path: Path | None = None, seed: int | None = None) -> None:
        servers = {s.name: s for s in load_inventory(path)}
        if server_name not in servers:
            raise ValueError(
                f"Unknown simulated server {server_name!r} in {path or DEFAULT_INVENTORY}; "
                f"known servers: {', '.join(servers)}"
            )
        self.server = server = servers[server_name]
        self._rng = random.Random(seed)
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
            if self._rng.random() < 0.6:
                self._start_job(card)
                card.utilization, card.memory_mb = card.target_utilization, card.target_memory_mb
            else:
                card.memory_mb = card.idle_memory_mb
            card.temperature = self._target_temperature(card)
            card.power_w = self._power(card)

    def snapshot(self) -> Snapshot:
        for card in self._cards:
            self._step(card)
        jobs = local_job_processes(self.server.name)
        return Snapshot(
            host=self.host, gpus=tuple(self._with_jobs(self._report(card), jobs) for card in self._cards)
        )

    @staticmethod
    def _with_jobs(report: GPUInfo, jobs: dict[str, list[ProcessInfo]]) -> GPUInfo:
        """Portal jobs booked on this simulated card run on the CPU here; show them on the
        card anyway (resident memory as "GPU memory") so the demo shows who holds what."""
        mine = jobs.get(report.uuid)
        if not mine:
            return report
        used = (report.memory_used_mb or 0) + sum(p.used_memory_mb or 0 for p in mine)
        return replace(
            report,
            processes=report.processes + tuple(mine),
            memory_used_mb=min(report.memory_total_mb, used),
            utilization_pct=max(report.utilization_pct or 0, 90),
        )

    def close(self) -> None:
        pass  # nothing held

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
        shares = (1.0,) if rng.random() < 0.7 else (0.6, 0.4)
        card.processes = [
            _FakeProcess(
                pid=rng.randint(2_000, 4_000_000),
                username=rng.choice(self.server.users),
                command=rng.choice(COMMANDS),
                memory_share=share,
            )
            for share in shares
        ]
        card.target_utilization = rng.uniform(55, 99)
        card.target_memory_mb = card.usable_mb * rng.uniform(0.35, 0.95)

    def _step(self, card: _Card) -> None:
        rng = self._rng
        if card.processes and rng.random() < JOB_FINISH_CHANCE:
            card.processes = []
        elif not card.processes and rng.random() < JOB_START_CHANCE:
            self._start_job(card)
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
