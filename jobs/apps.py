from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        # Imported here: models can be imported only once the app registry is ready.
        from gpus.services import telemetry_ingested
        from jobs import signals  # noqa: F401 - connects the worker signals
        from jobs.services import jobs_usage_record

        def record_usage(sender: object, *, cards: list, **kwargs: object) -> None:
            jobs_usage_record(cards=cards)

        # The collector (gpus) reports each telemetry round; jobs records its own usage rows.
        telemetry_ingested.connect(record_usage, weak=False, dispatch_uid="jobs_usage_record")
