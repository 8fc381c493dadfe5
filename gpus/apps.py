from django.apps import AppConfig


class GpusConfig(AppConfig):
    name = "gpus"
    verbose_name = "Servers and GPUs"

    def ready(self) -> None:
        from gpus import signals  # noqa: F401 - connects the worker signals
        from gpus.hosts import worker_servers
        from gpus.slots import slots_fill
        from portal.hosts import host_discovery_register

        host_discovery_register(worker_servers)  # what `make run` starts host workers for
        slots_fill()  # the quotas on portal's profile
