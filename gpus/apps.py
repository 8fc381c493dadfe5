from django.apps import AppConfig


class GpusConfig(AppConfig):
    name = "gpus"
    verbose_name = "Servers and GPUs"

    def ready(self) -> None:
        from gpus import signals  # noqa: F401 - connects the worker signals
