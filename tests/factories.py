from __future__ import annotations

import factory
from django.contrib.auth import get_user_model

from gpus.inventory import GPUInfo, HostInfo, ProcessInfo, Snapshot
from portal.models import Membership, Team


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.org")
    password = factory.django.Password("password")


class TeamFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Team

    name = factory.Sequence(lambda n: f"Team {n}")
    slug = factory.Sequence(lambda n: f"team-{n}")


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    team = factory.SubFactory(TeamFactory)
    user = factory.SubFactory(UserFactory)
    role = Membership.Role.MEMBER


def make_snapshot(
    server: str = "box1",
    gpus: int = 4,
    *,
    util: int = 10,
    memory_gb: int = 24,
    processes: int = 1,
    simulated: bool = False,
) -> Snapshot:
    """A host report as a backend would produce it, with stable UUIDs per server and index."""
    cards = tuple(
        GPUInfo(
            uuid=f"GPU-{server}-{i:02d}",
            index=i,
            name="NVIDIA Test Card",
            pci_bus_id=f"00000000:{0x1B + i:02X}:00.0",
            memory_total_mb=memory_gb * 1024,
            memory_reserved_mb=300,
            memory_used_mb=1000 + i,
            utilization_pct=util,
            temperature_c=40 + i,
            power_w=70.5,
            power_limit_w=300.0,
            mig_mode="disabled",
            processes=tuple(
                ProcessInfo(
                    pid=1000 + 10 * i + p, username="alice", command="python train.py", used_memory_mb=500
                )
                for p in range(processes)
            ),
        )
        for i in range(gpus)
    )
    host = HostInfo(
        name=server,
        hostname=f"{server}.lab",
        driver_version="550.90.07",
        cuda_version="12.4",
        cpu_count=32,
        ram_mb=256 * 1024,
        simulated=simulated,
    )
    return Snapshot(host=host, gpus=cards)


def job_form_data(booking, **overrides: object) -> dict:
    """The job form's fields as a browser posts them, for `booking` (None: none), with `overrides`."""
    data: dict = {
        "reservation": str(booking.pk) if booking is not None else "",
        "script_path": "",
        "args": "",
        "workdir": "",
        "interpreter": "default",
        "env": "",
        "time_limit_minutes": "",
        "memory_mode": "",
        "intra_op_threads": "",
        "inter_op_threads": "",
        "soft_placement": "on",
    }
    return data | overrides


def queue_job(user, gpus: int = 1, minutes: int = 60, **kwargs):  # type: ignore[no-untyped-def]
    """A job submitted to the queue (no booking): `gpus` cards for `minutes`."""
    from jobs.submit import ScriptUpload, job_submit

    kwargs.setdefault("script", ScriptUpload(name="train.py", content=b"print('hi')\n"))
    return job_submit(user=user, reservation=None, gpu_count=gpus, time_limit_minutes=minutes, **kwargs)


def fresh(obj):  # type: ignore[no-untyped-def]
    """`obj` as its row stands now."""
    obj.refresh_from_db()
    return obj
