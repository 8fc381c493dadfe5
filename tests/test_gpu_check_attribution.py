"""The attribution check's timing, on a scripted API: the card's `updated_at` is the latest round's
time when the API answers, not the time of the first round that showed the process. Rounds every
second; the helper says "held" at 1000.0. No clock, no portal."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from portal.gpu_check import checks_cards
from portal.gpu_check.waiting import Deadline

PID = 4242
NVML_MIB = checks_cards.ATTRIBUTION_MIB + 300  # the allocation and its CUDA context
HELD = 1000.0


def _context(answers: list[tuple[float, bool]]) -> SimpleNamespace:
    """Each API answer in turn: (the round its card row shows, seconds after "held"; whether that
    round showed the helper's process with NVML's memory)."""
    polls = iter(answers)

    def get(path: str) -> dict:
        stored, shown = next(polls)
        at = datetime.fromtimestamp(HELD + stored, tz=UTC).isoformat().replace("+00:00", "Z")
        process = {"pid": PID, "username": "alice", "used_memory_mb": NVML_MIB if shown else 300}
        return {"updated_at": at, "processes": [process]}

    helper = SimpleNamespace(pid=PID, wait_said=lambda word, deadline: HELD)
    return SimpleNamespace(
        portal=SimpleNamespace(settings={"TELEMETRY_INTERVAL_SECONDS": 1}, os_user="alice"),
        frameworks={"PyTorch": ""},
        cards=[{"uuid": "GPU-0"}],
        helper=lambda *args, uuid: helper,
        admin=SimpleNamespace(get=get),
        nvml=SimpleNamespace(processes=lambda uuid: {PID: NVML_MIB}),
    )


@pytest.mark.parametrize(
    ("answers", "status"),
    [
        # Quick answers: the round at 1.5 s is the first to show it.
        ([(0.5, False), (1.5, True)], "pass"),
        # A slow web server: the poll before saw the round at 0.5 s, the next one the round at
        # 4.5 s; the rounds at 1.5, 2.5 and 3.5 s went unseen, and any of them may have shown it.
        ([(0.5, False), (4.5, True)], "pass"),
        # The first answer already shows it: no round was seen without it.
        ([(4.5, True)], "pass"),
        # Quick answers, and the rounds up to 2.5 s did not show it: 3.5 s is late.
        ([(0.5, False), (1.5, False), (2.5, False), (3.5, True)], "fail"),
        # The round at 3.5 s did not show it: late, however slow the answers.
        ([(0.5, False), (3.5, False), (4.5, True)], "fail"),
        ([(0.5, False), (4.5, False), (5.5, True)], "fail"),
    ],
    ids=[
        "quick-answers",
        "slow-answers-unseen-rounds",
        "slow-first-answer",
        "quick-answers-late",
        "late-round-seen",
        "late-slow-answers",
    ],
)
def test_it_judges_the_first_round_that_could_have_shown_the_process(answers, status):
    [row] = checks_cards.check_attribution(_context(answers), Deadline(30))
    assert row.status == status, row.seen
