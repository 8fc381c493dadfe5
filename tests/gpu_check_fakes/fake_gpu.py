"""One fake GPU machine shared by every process of a test: the NVML the portal reads, the
`nvidia-smi` the check compares it with, and the PyTorch and JAX that jobs allocate with.

The machine is a folder, named by FAKE_GPU_DIR:

- ``cards.json``: the cards (uuid, name, memory in MiB, utilization, temperature, power);
- ``procs/<pid>.json``: the GPU memory each process holds, {uuid: bytes}, written by the fake
  frameworks as they allocate. A process holds it until it exits: NVML lists only live pids.

Standard library only: the fake `nvidia-smi` and the fake frameworks run in interpreters that
have nothing else. Only :class:`FileNvmlLib` needs pynvml (and tests/fake_nvml.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

STATE_ENV = "FAKE_GPU_DIR"
MIB = 2**20
CONTEXT_MIB = 300  # what a CUDA context holds on a card, as NVML counts it for the process


def state_dir() -> Path:
    return Path(os.environ[STATE_ENV])


def cards() -> list[dict[str, Any]]:
    return json.loads((state_dir() / "cards.json").read_text())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def processes() -> dict[str, list[tuple[int, int]]]:
    """{uuid: [(pid, bytes)]} of the live processes that hold memory."""
    held: dict[str, list[tuple[int, int]]] = {}
    folder = state_dir() / "procs"
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        pid = int(path.stem)
        if not _alive(pid):
            continue
        try:
            used = json.loads(path.read_text())
        except (OSError, ValueError):  # being replaced right now: next round
            continue
        for uuid, nbytes in used.items():
            held.setdefault(uuid, []).append((pid, nbytes))
    return held


def record(used: dict[str, int]) -> None:
    """This process now holds `used` ({uuid: bytes}); replaced whole, atomically."""
    folder = state_dir() / "procs"
    folder.mkdir(exist_ok=True)
    tmp = folder / f".{os.getpid()}.tmp"
    tmp.write_text(json.dumps(used))
    tmp.replace(folder / f"{os.getpid()}.json")


def visible(value: str | None) -> list[dict[str, Any]]:
    """The cards CUDA shows for this CUDA_VISIBLE_DEVICES: indices, UUIDs or unique prefixes of
    them; the list stops at the first entry that names no card, as CUDA's does."""
    every = cards()
    if value is None:
        return every
    shown: list[dict[str, Any]] = []
    for item in (part.strip() for part in value.split(",")):
        if item.isdigit():
            card = every[int(item)] if int(item) < len(every) else None
        else:
            matches = [c for c in every if item and c["uuid"].startswith(item)]
            card = matches[0] if len(matches) == 1 else None
        if card is None or card in shown:
            break
        shown.append(card)
    return shown


class Device:
    """One framework's allocations on the visible cards, capped per card; what NVML lists for
    the process is its context plus what it allocated, on each card it touched."""

    def __init__(self, oom: type[Exception], message: str) -> None:
        self.oom, self.message = oom, message
        self.cards: list[dict[str, Any]] | None = None
        self.caps: dict[int, int] = {}
        self.allocated: dict[int, int] = {}

    def start(self, value: str | None) -> None:
        if self.cards is None:
            self.cards = visible(value)

    def cap(self, index: int, fraction: float) -> None:
        assert self.cards is not None
        self.caps[index] = int(fraction * self.cards[index]["memory_total_mib"] * MIB)
        self.allocated.setdefault(index, 0)
        self._publish()

    def allocate(self, index: int, nbytes: int) -> None:
        assert self.cards is not None
        if index >= len(self.cards):
            raise RuntimeError(f"invalid device ordinal {index}: {len(self.cards)} visible")
        card = self.cards[index]
        limit = self.caps.get(index, (card["memory_total_mib"] - card["reserved_mib"]) * MIB)
        held = self.allocated.get(index, 0)
        if held + nbytes > limit:
            raise self.oom(self.message.format(nbytes=nbytes, mib=nbytes / MIB, held=held, limit=limit))
        self.allocated[index] = held + nbytes
        self._publish()

    def _publish(self) -> None:
        assert self.cards is not None
        record({self.cards[i]["uuid"]: CONTEXT_MIB * MIB + n for i, n in self.allocated.items()})


class _ImportHook:
    """Installs the file-backed NVML into pynvml as pynvml is first loaded (a find_spec alone,
    as the check's bootstrap does, loads nothing: the hook stays for the real import)."""

    def __init__(self) -> None:
        self.looking = False

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "pynvml" or self.looking:
            return None
        import importlib.util

        self.looking = True
        try:
            spec = importlib.util.find_spec("pynvml")
        finally:
            self.looking = False
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def load(module: Any) -> None:
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            install(module)

        spec.loader.exec_module = load  # type: ignore[method-assign]
        return spec


def install_when_imported() -> None:
    sys.meta_path.insert(0, _ImportHook())


def install(pynvml: Any) -> None:
    from types import SimpleNamespace

    from tests import fake_nvml

    class FileNvmlLib(fake_nvml.FakeNvmlLib):
        """tests/fake_nvml.py's C library, its cards and processes read from the folder."""

        @property
        def cards(self) -> list[fake_nvml.FakeCard]:
            held = processes()
            made = []
            for index, card in enumerate(cards()):
                listed = held.get(card["uuid"], [])
                used = card["base_used_mib"] * MIB + sum(n for _, n in listed)
                fake = fake_nvml.FakeCard(
                    index,
                    name=card["name"],
                    memory=(card["memory_total_mib"] * MIB, card["reserved_mib"] * MIB, used),
                    utilization=card["utilization"],
                    temperature=card["temperature"],
                    power_mw=card["power_mw"],
                    processes=list(listed),
                )
                assert fake.uuid == card["uuid"], "cards.json: uuids are tests/fake_nvml.FakeCard's"
                made.append(fake)
            return made

        @cards.setter
        def cards(self, value: Any) -> None:  # FakeNvmlLib.__init__ sets its own two: not here
            pass

    fake_nvml.install(SimpleNamespace(setattr=setattr), FileNvmlLib(process_pid=os.getpid()))
