"""The watchdog's rules as a pure function: every kind, from facts alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpus.inventory import GPUInfo, ProcessInfo
from jobs.watchdog.rules import BookingFacts, JobFacts, Kind, classify

A, B, C = "GPU-a", "GPU-b", "GPU-c"
ALICE, BOB = 1, 2
TOLERANCE = 256


def card(uuid: str, *processes: ProcessInfo) -> GPUInfo:
    return GPUInfo(uuid=uuid, index=0, name="card", pci_bus_id="", memory_total_mb=24576, processes=processes)


def proc(pid: int, *, session: int | None = None, user: str = "alice", mb: int = 1000) -> ProcessInfo:
    return ProcessInfo(pid=pid, username=user, command="python", used_memory_mb=mb, session_id=session or pid)


# alice holds A whole and 8 GiB of B; her job 7 runs in session 100 on that booking.
BOOKINGS = [BookingFacts(reservation_id=50, owner_id=ALICE, cards={A: None, B: 8192})]
JOB = JobFacts(job_id=7, session_id=100, owner_id=ALICE, reservation_id=50, running=True)
USERS = {"alice": ALICE, "bob": BOB}


def kinds(*cards: GPUInfo, jobs=(JOB,), bookings=BOOKINGS) -> list[Kind]:
    verdicts = classify(cards, bookings=bookings, jobs=jobs, users_by_os_name=USERS, tolerance_mb=TOLERANCE)
    return [v.kind for v in verdicts]


def test_a_job_on_its_booked_cards_within_its_memory_is_ok():
    assert kinds(card(A, proc(100, mb=70_000)), card(B, proc(101, session=100, mb=8192))) == [
        Kind.OK,
        Kind.OK,
    ]


def test_a_job_on_a_card_its_booking_does_not_hold_has_escaped():
    (verdict,) = classify(
        [card(C, proc(100))], bookings=BOOKINGS, jobs=[JOB], users_by_os_name=USERS, tolerance_mb=TOLERANCE
    )
    assert (verdict.kind, verdict.job_id, verdict.user_id) == (Kind.ESCAPED, 7, ALICE)


def test_memory_on_a_shared_card_is_the_jobs_sum_against_its_booking_plus_tolerance():
    within = card(B, proc(100, mb=4000), proc(101, session=100, mb=4192 + TOLERANCE))
    over = card(B, proc(100, mb=4000), proc(101, session=100, mb=4193 + TOLERANCE))
    assert kinds(within) == [Kind.OK, Kind.OK]
    assert kinds(over) == [Kind.OVER_MEMORY, Kind.OVER_MEMORY]
    (first, _) = classify(
        [over], bookings=BOOKINGS, jobs=[JOB], users_by_os_name=USERS, tolerance_mb=TOLERANCE
    )
    assert first.memory_mb == 8193 + TOLERANCE


def test_a_whole_card_has_no_memory_rule():
    assert kinds(card(A, proc(100, mb=80_000))) == [Kind.OK]


@pytest.mark.parametrize(
    ("user", "expected"),
    [("bob", Kind.INTRUDER), ("alice", Kind.OWNER_OUTSIDE_JOB), ("mallory", Kind.INTRUDER)],
)
def test_a_foreign_process_on_a_booked_card(user, expected):
    (verdict,) = classify(
        [card(A, proc(300, user=user))], bookings=BOOKINGS, jobs=[JOB], users_by_os_name=USERS, tolerance_mb=0
    )
    assert (verdict.kind, verdict.reservation_id, verdict.job_id) == (expected, 50, None)
    assert verdict.user_id == USERS.get(user)


def test_a_foreign_process_on_a_card_nobody_booked_is_unbooked():
    assert kinds(card(C, proc(300, user="bob"))) == [Kind.UNBOOKED]


def test_a_process_left_in_an_ended_jobs_session_is_a_zombie():
    ended = replace(JOB, running=False)
    assert kinds(card(A, proc(101, session=100)), jobs=[ended]) == [Kind.ZOMBIE]


def test_an_invented_process_without_a_session_is_never_a_job():
    """The simulation's made-up processes have no session: they can only be foreign."""
    assert kinds(card(A, ProcessInfo(pid=100, username="alice", command="x", used_memory_mb=1))) == [
        Kind.OWNER_OUTSIDE_JOB
    ]


def test_an_unreadable_process_list_yields_no_verdict():
    assert kinds(replace(card(A), processes=None)) == []


# --- the owner's own processes on a shared card (issue 19) ---------------------------------------


def verdicts_on(*cards: GPUInfo, jobs=(JOB,), bookings=BOOKINGS):
    return classify(cards, bookings=bookings, jobs=jobs, users_by_os_name=USERS, tolerance_mb=TOLERANCE)


def test_the_owners_notebook_within_the_booking_is_owner_outside_job():
    (verdict,) = verdicts_on(card(B, proc(300, mb=8192 + TOLERANCE)))
    assert verdict.kind == Kind.OWNER_OUTSIDE_JOB


def test_the_owners_notebook_above_the_shared_booking_is_over_memory():
    (verdict,) = verdicts_on(card(B, proc(300, mb=8193 + TOLERANCE)))
    assert (verdict.kind, verdict.memory_mb, verdict.booked_mb) == (Kind.OVER_MEMORY, 8193 + TOLERANCE, 8192)
    assert (verdict.user_id, verdict.reservation_id, verdict.job_id) == (ALICE, 50, None)


def test_the_owners_processes_inside_and_outside_jobs_are_summed_against_the_booking():
    """Her job (5000) is within the booking alone; with her notebook (4000) she holds 9000 of 8192."""
    job, notebook = verdicts_on(card(B, proc(100, mb=5000), proc(300, mb=4000)))
    assert job.kind == Kind.OK
    assert (notebook.kind, notebook.memory_mb, notebook.booked_mb) == (Kind.OVER_MEMORY, 9000, 8192)


def test_a_jobs_child_that_left_its_session_still_counts_against_the_owners_booking():
    """setsid under JOB_USER=@owner: a session of its own, run by the owner's Unix account."""
    job, child = verdicts_on(card(B, proc(100, mb=6000), proc(400, session=400, mb=3000)))
    assert (job.kind, child.kind) == (Kind.OK, Kind.OVER_MEMORY)


def test_the_owner_of_a_whole_card_has_no_memory_rule():
    (verdict,) = verdicts_on(card(A, proc(300, mb=80_000)))
    assert verdict.kind == Kind.OWNER_OUTSIDE_JOB


# --- a booking that has just ended (issue 19) -----------------------------------------------------


def test_a_job_on_its_card_of_a_booking_that_just_ended_has_not_escaped():
    ended = [replace(BOOKINGS[0], ended=True)]
    assert kinds(card(A, proc(100)), bookings=ended) == [Kind.OK]


def test_a_booking_that_just_ended_protects_nobody_else():
    """For anyone but its own jobs the card is free again: another's process there is unbooked."""
    ended = [replace(BOOKINGS[0], ended=True)]
    assert kinds(card(A, proc(300, user="bob")), bookings=ended) == [Kind.UNBOOKED]


def test_a_job_whose_booking_is_gone_for_good_has_escaped():
    assert kinds(card(A, proc(100)), bookings=[]) == [Kind.ESCAPED]


def test_every_cuda_context_a_job_opens_counts_against_its_booking():
    """No allowance per extra context: the card's bookable memory leaves headroom for one
    context, so each further process's context (~300-500 MiB) comes out of the job's booking."""
    three = card(B, proc(100, mb=3000), proc(101, session=100, mb=3000), proc(102, session=100, mb=3000))
    assert kinds(three) == [Kind.OVER_MEMORY] * 3


# --- a process's own session before the one it left (review of 1ab5ded) ---------------------------


def test_a_gpu_exec_started_inside_a_job_is_its_sessions_not_the_jobs_escape():
    """alice's job 7 (session 100, booking 50) runs `gpu exec` on her other booking 60, card C: the
    command leads session 400, which `gpu` recorded, and left the job's session. Its own session
    says whose it is (OK on booking 60); the session it left (the job's) must not make it job 7's
    process on a card booking 50 does not hold (escaped: the job stopped), nor count in job 7's sum."""
    from jobs.watchdog.rules import SessionFacts

    bookings = [*BOOKINGS, BookingFacts(reservation_id=60, owner_id=ALICE, cards={C: None})]
    command = replace(proc(401, session=400), parent_session_id=100)
    session = SessionFacts(session_pk=9, session_id=400, owner_id=ALICE, reservation_id=60)
    (verdict,) = classify(
        [card(C, command)],
        bookings=bookings,
        jobs=[JOB],
        users_by_os_name=USERS,
        tolerance_mb=TOLERANCE,
        sessions=[session],
    )
    assert (verdict.kind, verdict.job_id, verdict.session_pk) == (Kind.OK, None, 9)


def test_a_claim_on_a_jobs_child_by_someone_else_leaves_it_the_jobs():
    """A `gpu exec` pid is its owner's word: bob naming the session of alice's job's setsid child
    must not take the child from the job (it would be judged an intruder on alice's own card)."""
    from jobs.watchdog.rules import SessionFacts

    child = replace(proc(501, session=501, user="gpujob"), parent_session_id=100)
    claim = SessionFacts(session_pk=9, session_id=501, owner_id=BOB, reservation_id=50)
    (verdict,) = classify(
        [card(A, child)],
        bookings=BOOKINGS,
        jobs=[JOB],
        users_by_os_name=USERS,
        tolerance_mb=0,
        sessions=[claim],
    )
    assert (verdict.kind, verdict.job_id) == (Kind.OK, 7)
