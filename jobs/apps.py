from django.apps import AppConfig
from django.db.models.signals import post_delete


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        from gpus.conflicts import queue_holds_answered_by
        from gpus.hooks import (
            interactive_sessions_answered_by,
            job_outcomes_answered_by,
            job_sessions_answered_by,
            own_jobs_answered_by,
            work_on_booking_answered_by,
        )
        from jobs import (
            signals,  # noqa: F401 - connects the worker and telemetry signals
            tasks,  # noqa: F401 - registers run_job, which dispatch sends by name
        )
        from jobs.interactive import booking_sessions_context, sessions_by_session, work_on
        from jobs.leavers import membership_deleted
        from jobs.scheduler import queue_holds
        from jobs.selectors import jobs_finished_between, jobs_owned_by
        from jobs.services import jobs_by_session
        from portal.models import Membership
        from portal.slots import RESERVATION_ACTIONS, RESERVATION_SESSIONS, slot_fill

        own_jobs_answered_by(jobs_owned_by)  # whose job a GPU process is, for its command line
        job_sessions_answered_by(jobs_by_session)  # which job each reported process runs for
        interactive_sessions_answered_by(sessions_by_session)  # and which gpu exec or lab
        work_on_booking_answered_by(work_on)  # what a release or cancel would stop: asked first
        job_outcomes_answered_by(jobs_finished_between)  # the usage rollup's jobs by outcome
        queue_holds_answered_by(queue_holds)  # the plan's shadows, which user bookings leave free
        slot_fill(RESERVATION_ACTIONS, "jobs/_run_buttons.html")  # Run buttons on gpus' booking pages
        slot_fill(RESERVATION_SESSIONS, "jobs/_booking_sessions.html", booking_sessions_context)
        # A member who leaves a team takes their queued jobs of it along (jobs.leavers).
        post_delete.connect(membership_deleted, sender=Membership, dispatch_uid="jobs_team_leaver")
