from django.apps import AppConfig
from django.db.models.signals import post_delete


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        from gpus.selectors import own_jobs_answered_by
        from jobs import (
            signals,  # noqa: F401 - connects the worker and telemetry signals
            tasks,  # noqa: F401 - registers run_job, which dispatch sends by name
        )
        from jobs.leavers import membership_deleted
        from jobs.selectors import jobs_owned_by
        from portal.models import Membership
        from portal.slots import RESERVATION_ACTIONS, slot_fill

        own_jobs_answered_by(jobs_owned_by)  # whose job a GPU process is, for its command line
        slot_fill(RESERVATION_ACTIONS, "jobs/_run_buttons.html")  # Run buttons on gpus' booking pages
        # A member who leaves a team takes their queued jobs of it along (jobs.leavers).
        post_delete.connect(membership_deleted, sender=Membership, dispatch_uid="jobs_team_leaver")
