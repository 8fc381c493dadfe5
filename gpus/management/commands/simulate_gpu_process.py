"""Show a real local process on a SIMULATED card, so the watchdog can be tried without a GPU.

The declarations live in SIMULATED_PROCESSES_FILE, which every simulated host worker on this
machine reads each telemetry round: a running `make run` shows a declared process within one
interval, with its real user, command line and session, as NVML would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from gpus.models import GPU
from gpus.procinfo import describe_process
from gpus.simulated.declarations import (
    DeclarationsError,
    DeclaredProcess,
    declared_processes,
    simulated_process_declare,
    simulated_process_remove,
)


class Command(BaseCommand):
    help = (
        "Declare that a real process of this machine uses GPU memory on a simulated card "
        "(--gpu, --pid, --memory-mb); --remove --pid takes it back, --list shows the declarations."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        action = parser.add_mutually_exclusive_group()
        action.add_argument(
            "--remove", action="store_true", help="take back --pid's declarations (on --gpu only, if given)"
        )
        action.add_argument("--list", action="store_true", help="print the current declarations")
        parser.add_argument(
            "--gpu", metavar="UUID", help="a simulated card's UUID, from its page on the dashboard"
        )
        parser.add_argument("--pid", type=int, help="a live process of this machine")
        parser.add_argument(
            "--memory-mb", type=int, metavar="MIB", help="the GPU memory it holds on the card, in MiB"
        )

    def handle(self, *args: str, **options: Any) -> None:
        path = Path(settings.SIMULATED_PROCESSES_FILE)
        gpu, pid, memory_mb = options["gpu"], options["pid"], options["memory_mb"]
        try:
            if options["list"]:
                self._list(path)
            elif options["remove"]:
                if pid is None:
                    raise CommandError("--remove needs --pid: the process whose declarations to take back.")
                self._remove(path, pid, gpu)
            else:
                if gpu is None or pid is None or memory_mb is None:
                    raise CommandError("Declaring a process needs --gpu, --pid and --memory-mb.")
                self._declare(path, _simulated_card(gpu), pid, memory_mb)
        except DeclarationsError as exc:
            raise CommandError(f"{exc}. Fix the file, or delete it to start afresh.") from None
        except OSError as exc:  # the file or its folder cannot be written: say which
            raise CommandError(str(exc)) from None

    def _declare(self, path: Path, card: GPU, pid: int, memory_mb: int) -> None:
        _check_memory(card, memory_mb)
        try:
            previous = simulated_process_declare(path=path, gpu=card.uuid, pid=pid, memory_mb=memory_mb)
        except ProcessLookupError:
            raise CommandError(
                f"--pid {pid}: no such process on this machine. Start one, e.g. "
                "`python -c 'import time; time.sleep(600)' &`, and pass its pid ($!)."
            ) from None
        if previous is not None:
            self.stdout.write(
                f"Updated pid {pid} on {_card_name(card)}: {previous.memory_mb} → {memory_mb} MiB."
            )
            return
        process = describe_process(pid, memory_mb)
        self.stdout.write(
            f"Declared pid {pid} ({process.username}: {process.command}) on {_card_name(card)}: "
            f"{memory_mb} MiB. Its host worker shows it within {settings.WATCHDOG_INTERVAL_SECONDS} s."
        )

    def _remove(self, path: Path, pid: int, gpu: str | None) -> None:
        removed = simulated_process_remove(path=path, pid=pid, gpu=gpu)
        cards = _cards_by_uuid(removed)
        for declared in removed:
            self.stdout.write(f"Removed pid {pid} from {_card_name_of(declared.gpu, cards)}.")
        if not removed:
            where = f" on {gpu}" if gpu else ""
            self.stdout.write(
                f"Nothing to remove: pid {pid} is not declared{where} "
                "(a process that exited is dropped on its own)."
            )

    def _list(self, path: Path) -> None:
        running = [d for d in declared_processes(path) if d.is_running()]
        if not running:
            self.stdout.write(f"No simulated GPU processes declared (in {path}).")
            return
        cards = _cards_by_uuid(running)
        for declared in running:
            process = describe_process(declared.pid, declared.memory_mb)
            self.stdout.write(
                f"pid {declared.pid} on {_card_name_of(declared.gpu, cards)}: "
                f"{declared.memory_mb} MiB ({process.username}: {process.command})"
            )


def _simulated_card(uuid: str) -> GPU:
    """The portal's card `uuid`, which must be on a simulated server; CommandError otherwise."""
    card = GPU.objects.select_related("server").filter(uuid=uuid).first()
    if card is None:
        raise CommandError(
            f"--gpu {uuid}: no such card in the portal. Copy a simulated card's UUID from its page "
            "on the dashboard (the simulated servers appear once `make run` has started)."
        )
    if not card.server.simulated:
        raise CommandError(
            f"--gpu {uuid} is on {card.server.name}, which is not simulated: "
            "real cards report their own processes."
        )
    return card


def _check_memory(card: GPU, memory_mb: int) -> None:
    if not 0 < memory_mb <= card.memory_total_mb:
        raise CommandError(
            f"--memory-mb {memory_mb}: expected a positive number of MiB, "
            f"at most the card's {card.memory_total_mb} MiB."
        )


def _cards_by_uuid(declared: list[DeclaredProcess]) -> dict[str, GPU]:
    uuids = {d.gpu for d in declared}
    return {card.uuid: card for card in GPU.objects.select_related("server").filter(uuid__in=uuids)}


def _card_name(card: GPU) -> str:
    return f"{card.server.name} card {card.index} ({card.uuid})"


def _card_name_of(uuid: str, cards: dict[str, GPU]) -> str:
    return _card_name(cards[uuid]) if uuid in cards else f"{uuid} (a card the portal does not know)"
