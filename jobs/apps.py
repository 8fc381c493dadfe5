from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        from gpus.selectors import own_jobs_answered_by
        from jobs import signals  # noqa: F401 - connects the worker and telemetry signals
        from jobs.selectors import jobs_owned_by

        own_jobs_answered_by(jobs_owned_by)  # whose job a GPU process is, for its command line
