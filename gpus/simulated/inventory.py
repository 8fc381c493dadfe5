"""The simulated inventory: its YAML file of servers and cards, read and validated.

Every field is checked with a message that names it (`servers[0].gpus[1].count: expected a
positive integer, got 0`), so a typo in a demo's inventory is found at start-up, not as odd
telemetry. The checkers (`checked_mapping`, `checked_field`, `is_*`) are the declarations file's
too (gpus.simulated.declarations).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# The shipped inventory stays beside the package (SIMULATED_INVENTORY's default, in the docs).
DEFAULT_INVENTORY = Path(__file__).parent.parent / "simulated_inventory.yaml"

MAX_GPUS_PER_SERVER = 64


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


_MISSING = object()
_SLUG = re.compile(r"^[-a-zA-Z0-9_]+$")


def is_text(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def is_positive_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _is_user_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(is_text(u) for u in value)


def checked_mapping(value: object, where: str, fields: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InventoryError(f"{where or 'top level'}: expected a mapping, got {value!r}")
    unknown = sorted(set(value) - fields)
    if unknown:
        prefix = f"{where}." if where else ""
        raise InventoryError(f"{prefix}{unknown[0]}: unknown field (known: {', '.join(sorted(fields))})")
    return value


def checked_field(
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
    data = checked_mapping(data, where, {"model", "count", "memory_gb", "power_limit_w", "mig_mode"})
    return SimulatedGPUSpec(
        model=checked_field(data, "model", where, is_text, "a model name"),
        count=checked_field(data, "count", where, is_positive_int, "a positive integer"),
        memory_gb=checked_field(data, "memory_gb", where, is_positive_number, "a positive number"),
        power_limit_w=checked_field(data, "power_limit_w", where, is_positive_number, "a positive number"),
        mig_mode=checked_field(
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
    data = checked_mapping(data, where, fields | {"users", "gpus"})
    version = "a quoted string such as '12.4'"  # unquoted 12.4 is a YAML float
    name = checked_field(
        data,
        "name",
        where,
        lambda v: isinstance(v, str) and bool(_SLUG.match(v)),
        "a slug (letters, digits, - and _)",
    )
    specs = checked_field(data, "gpus", where, lambda v: isinstance(v, list) and bool(v), "a list")
    gpus = tuple(_gpu_spec(spec, f"{where}.gpus[{i}]") for i, spec in enumerate(specs))
    if sum(g.count for g in gpus) > MAX_GPUS_PER_SERVER:
        raise InventoryError(f"{where}.gpus: more than {MAX_GPUS_PER_SERVER} GPUs in one server")
    return SimulatedServer(
        name=name,
        hostname=checked_field(data, "hostname", where, is_text, "a host name", default=name),
        cpu_count=checked_field(data, "cpu_count", where, is_positive_int, "a positive integer"),
        ram_gb=checked_field(data, "ram_gb", where, is_positive_number, "a positive number"),
        driver_version=checked_field(data, "driver_version", where, is_text, version),
        cuda_version=checked_field(data, "cuda_version", where, is_text, version),
        users=tuple(
            checked_field(data, "users", where, _is_user_list, "a list of user names", default=users)
        ),
        gpus=gpus,
    )


def load_inventory(path: Path | None = None) -> list[SimulatedServer]:
    """Read and validate an inventory; InventoryError names the file and the bad field."""
    path = path or DEFAULT_INVENTORY
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        data = checked_mapping(data, "", {"users", "servers"})
        users = tuple(checked_field(data, "users", "", _is_user_list, "a list of user names"))
        raw = checked_field(
            data, "servers", "", lambda v: isinstance(v, list) and bool(v), "a list of servers"
        )
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
