from django.apps import AppConfig
from django.db.models.signals import post_delete


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        """jobs' answers to what the apps below ask (gpus/hooks.py, portal/hooks.py), given once."""
        from gpus.hooks import Answers, answered_by
        from jobs import (
            signals,  # noqa: F401 - connects the worker and telemetry signals
            tasks,  # noqa: F401 - registers run_job and run_session (sent by name: jobs.sessions.services)
        )
        from jobs.leavers import membership_deleted
        from jobs.lending import lent_context, loan_words
        from jobs.lending_report import reports_context
        from jobs.models import JOB_CHANGE_TOLD
        from jobs.notices import job_change_notify
        from jobs.queue.scheduler import queue_holds
        from jobs.selectors import job_images, jobs_finished_between, jobs_owned_by, jobs_peak_memory
        from jobs.services import jobs_by_session
        from jobs.sessions.services import (
            booking_sessions_context,
            lab_images_context,
            sessions_by_session,
            work_on,
        )
        from portal.hooks import REPORTS_LENDING, RESERVATION_ACTIONS, RESERVATION_SESSIONS, slot_fill
        from portal.models import Membership

        answered_by(
            Answers(
                job_sessions=jobs_by_session,  # which job each reported process runs for
                interactive_sessions=sessions_by_session,  # and which gpu exec or lab
                job_outcomes=jobs_finished_between,  # the usage rollup's jobs by outcome
                own_jobs=jobs_owned_by,  # whose job a GPU process is, for its command line
                job_images=job_images,  # the image a job's processes run in, beside "job N"
                work_on_booking=work_on,  # what a release or cancel would stop: asked first
                queue_holds=queue_holds,  # the plan's shadows, which user bookings leave free
                loan_words=loan_words,  # a lent card's words on the dashboard
                jobs_peak_memory=jobs_peak_memory,  # Reports: the jobs' own peak beside the cards'
            )
        )
        # A job's start and end told to its owner, with the change itself (jobs/notices.py).
        if job_change_notify not in JOB_CHANGE_TOLD:
            JOB_CHANGE_TOLD.append(job_change_notify)
        # Run buttons on gpus' booking pages, with the images JupyterLab may run in there.
        slot_fill(RESERVATION_ACTIONS, "jobs/_run_buttons.html", lab_images_context)
        slot_fill(RESERVATION_SESSIONS, "jobs/_booking_sessions.html", booking_sessions_context)
        # A lent booking's words, and its owner's Take it back (jobs/lending.py).
        slot_fill(RESERVATION_SESSIONS, "jobs/_booking_lent.html", lent_context)
        # What lending saved, on the Reports page (jobs/lending_report.py).
        slot_fill(REPORTS_LENDING, "jobs/_reports_lending.html", reports_context)
        # A member who leaves a team takes their queued jobs of it along (jobs.leavers).
        post_delete.connect(membership_deleted, sender=Membership, dispatch_uid="jobs_team_leaver")
