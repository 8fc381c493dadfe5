"""A job's environment and launch configuration, from its booking: a pure function.

`job_environment` reads nothing but its arguments (no files, no os.environ, no settings, no
database), so every rule about what a job sees is unit-tested without a worker. The runner
gathers the facts (the booked card, the worker's environment, the settings, the JOB_USER
account), calls it, and does everything with side effects: folders, the upload, chown, Popen.
"""

from __future__ import annotations

import json
import math
import posixpath
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpus.models import GPU, Allocation
from gpus.process_env import INSTANCE_VAR, SERVER_VAR
from jobs.models import InteractiveSession, Job

LAUNCH_CONFIG_VAR = "PORTAL_LAUNCH_CONFIG"  # read (and removed) by jobs/host/launcher-bin/launcher.py
# JAX's memory settings (jaxlib's generate_pjrt_gpu_plugin_options). Every jaxlib reads the older name
# of the fraction; newer ones prefer XLA_CLIENT_MEM_FRACTION and refuse a process that sets both (a
# ValueError, and JAX falls back to the CPU), so the portal sets the older one and keeps the newer out.
JAX_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
JAX_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_MEM_FRACTION_NEW = "XLA_CLIENT_MEM_FRACTION"
# The portal's own variables: `job_environment` sets them over the job's own, and job_submit
# refuses them (tests/test_job_env.py checks the function sets no other of its own).
PORTAL_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "TF_FORCE_GPU_ALLOW_GROWTH",
        "TF_NUM_INTRAOP_THREADS",
        "TF_NUM_INTEROP_THREADS",
        "OMP_NUM_THREADS",
        "PYTHONUNBUFFERED",
        "PORTAL_JOB_ID",
        "PORTAL_RESERVATION_ID",
        "PORTAL_SERVER",
        "PORTAL_INSTANCE",
        "PORTAL_ARRAY_INDEX",
        LAUNCH_CONFIG_VAR,
        JAX_PREALLOCATE,
        JAX_MEM_FRACTION,
    }
)
# Refused at submit as well, though the portal leaves them unset: they would reach past the
# booking (other cards through the container runtime or MPS, other hosts through TF_CONFIG, the
# whole card through JAX's newer fraction, which also breaks JAX beside the portal's).
RESERVED_ENV = PORTAL_ENV | {"NVIDIA_VISIBLE_DEVICES", "TF_CONFIG", JAX_MEM_FRACTION_NEW}
RESERVED_PREFIXES = ("PORTAL_", "CUDA_MPS_")
# Inherited from the worker's environment; everything else (DATABASE_URL, SECRET_KEY,
# REDIS_URL, TF_CONFIG, ...) stays out of the user's job. Not VIRTUAL_ENV or CONDA_PREFIX:
# they describe the worker's interpreter, and a job runs its own (`job_environment` puts that
# one's folder first on PATH, so `pip` in a job never writes into the portal's venv).
INHERITED_ENV = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "USER",
    "LOGNAME",
    "SHELL",
    "TMPDIR",
    "LD_LIBRARY_PATH",
    "CUDA_HOME",
    "CUDA_PATH",
    "XLA_FLAGS",
    # Lab networks are often closed: jobs reach pip, dataset and model downloads
    # (keras.datasets, pretrained weights) through the site's proxy, as the worker does.
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
)
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
TF_LOG_LEVEL = "1"  # the user's variables may change it; nothing else of the portal's


class JobSetupError(Exception):
    """The job cannot start here (missing script, interpreter or folder; a card it cannot be
    given): it FAILS, no retry."""


class MigCardRefused(JobSetupError):
    """A booked card is in MIG mode: the job cannot be given it (see `mig_refusal`)."""


@dataclass(frozen=True)
class BookedCard:
    """One card of the booking, as the environment needs it. Every card of a booking holds the
    same `memory_mb`, so one card's facts stand for all; MIG mode is each card's own, so
    `mig_uuids` lists every card of the booking that has it on."""

    memory_mb: int | None  # the booked share; None: the whole card
    total_mb: int
    bookable_mb: int  # what bookings may share: total - driver reserved - context headroom
    mig_uuids: tuple[str, ...] = ()  # the booking's cards in MIG mode, as last reported

    @classmethod
    def of(cls, allocation: Allocation) -> BookedCard:
        gpu = allocation.gpu
        mig: tuple[str, ...] = (gpu.pk,) if gpu.mig_mode == "enabled" else ()
        if allocation.reservation_id is not None:
            cards = GPU.objects.filter(allocations__reservation_id=allocation.reservation_id)
            mig = tuple(cards.filter(mig_mode="enabled").order_by("pk").values_list("pk", flat=True))
        return cls(
            memory_mb=allocation.memory_mb,
            total_mb=gpu.memory_total_mb,
            bookable_mb=gpu.memory_bookable_mb,
            mig_uuids=mig,
        )


def mig_refusal(mig_uuids: tuple[str, ...]) -> str:
    """Why a job is not started on a MIG card. On a card in MIG mode CUDA runs only on MIG
    instances, named in CUDA_VISIBLE_DEVICES by their own MIG-... UUIDs; the inventory knows
    the cards' UUIDs, not their instances', and the card's own UUID would not keep the job to
    one instance of it (nor to the memory booked)."""
    cards = ", ".join(mig_uuids)
    return (
        f"MIG mode is enabled on {cards}: the portal does not book MIG instances, and CUDA needs an "
        "instance's MIG-... UUID there, not the card's. Book a card without MIG, or ask an admin to "
        "turn MIG off on it (nvidia-smi -i <index> -mig 0)."
    )


@dataclass(frozen=True)
class JobEnvironment:
    env: dict[str, str]  # the subprocess's whole environment, PORTAL_LAUNCH_CONFIG included
    applied: dict[str, str]  # the portal's own variables, shown on the job's page
    config: dict[str, Any]  # the launch configuration (also in env as JSON)


def booked_memory(mode: str, card: BookedCard, *, headroom_mb: int) -> tuple[int | None, float | None]:
    """TF memory_limit per card (limit modes) and the fraction of the card (all but "take all"),
    which caps TF1 sessions, JAX and PyTorch.

    Both cap the same memory: the booking less the CUDA context's headroom, because the context
    and cuDNN sit outside every framework's allocator (a cap of the whole booking plus the context
    would exceed it). A whole card's bookable memory already leaves the headroom; a share does not.
    """
    if mode == Job.MemoryMode.ALL:
        return None, None
    usable = max(1, card.bookable_mb if card.memory_mb is None else card.memory_mb - headroom_mb)
    # TF takes fraction × the card's total: rounded down, so that is never more than `usable`. Not
    # to 0, which TF reads as "no cap": even a share at or below the headroom (allowed when growing)
    # keeps 1 MiB, more than a millionth of any card.
    fraction = math.floor(usable * 10**6 / (card.total_mb or 1)) / 10**6
    return (None if mode == Job.MemoryMode.GROW else usable), fraction


def framework_memory_env(card: BookedCard, *, headroom_mb: int, mode: str) -> dict[str, str]:
    """The memory caps that frameworks read from the environment, for any process on a booking
    (a job now; `gpu exec` and sessions can set the same).

    The cap is `booked_memory`'s fraction of the card: the booking less the CUDA context's
    headroom (a whole card: its bookable memory). "Take all" (whole cards only) caps nothing, so
    every framework keeps its own default on a card that is the booking's alone.

    - JAX: no preallocation, and the fraction as the BFC allocator's limit, which holds while it
      grows (JAX's default is 75 % of the card at the first operation, on any card).
    - TensorFlow: none here; the launcher applies `tf.config` (see `launch_config`).
    - PyTorch: none. `per_process_memory_fraction` in PYTORCH_CUDA_ALLOC_CONF is known only to the
      newest PyTorch (pytorch/pytorch#161035), and every older one stops at the first CUDA
      allocation on a key it does not know ("Unrecognized CachingAllocator option"), so the
      launcher calls `torch.cuda.set_per_process_memory_fraction` instead. The job's own
      PYTORCH_CUDA_ALLOC_CONF (expandable_segments, ...) reaches it untouched.
    """
    fraction = booked_memory(mode, card, headroom_mb=headroom_mb)[1]
    if fraction is None:
        return {}
    # Six places, as booked_memory rounds it: "0.3125", not "0.312500".
    return {JAX_PREALLOCATE: "false", JAX_MEM_FRACTION: f"{fraction:.6f}".rstrip("0").rstrip(".")}


def job_environment(
    job: Job,
    card: BookedCard,
    *,
    inherited: Mapping[str, str],
    interpreter: str,
    venv: str | None = None,
    server: str,
    instance: str,
    headroom_mb: int,
    account: pwd.struct_passwd | None = None,
) -> JobEnvironment:
    """What the job's process sees.

    `inherited` is the worker's environment: only INHERITED_ENV passes. `interpreter` is the
    job's Python (its JOB_INTERPRETERS path) and `venv` the virtual environment it belongs to,
    if the runner found one: the job sees them as if that environment were activated. `server`
    is WORKER_SERVER, `instance` PORTAL_INSTANCE_ID (which portal on this machine started the
    job: the simulated backend shows no other portal's jobs), `headroom_mb`
    GPU_CONTEXT_HEADROOM_MB, `account` JOB_USER's (its HOME, USER and LOGNAME). The job's own
    variables come next, and the portal's (PORTAL_ENV) last: a job cannot override them
    (job_submit refuses to store them in the first place).

    Raises MigCardRefused for a booking with a card in MIG mode (`mig_refusal`).
    """
    if card.mig_uuids:
        raise MigCardRefused(mig_refusal(card.mig_uuids))
    config = launch_config(job, card, headroom_mb=headroom_mb)
    threads = {
        "TF_NUM_INTRAOP_THREADS": job.intra_op_threads,
        "TF_NUM_INTEROP_THREADS": job.inter_op_threads,
        "OMP_NUM_THREADS": job.intra_op_threads,
    }
    portal = {
        "CUDA_VISIBLE_DEVICES": ",".join(job.gpu_uuids),  # UUIDs, in the booking's order
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # indices as nvidia-smi shows them; UUIDs are exact anyway
        "TF_FORCE_GPU_ALLOW_GROWTH": "true" if config["allow_growth"] else "false",
        **{name: str(value) for name, value in threads.items() if value},
        "PYTHONUNBUFFERED": "1",
        "PORTAL_JOB_ID": str(job.pk),
        "PORTAL_RESERVATION_ID": str(job.reservation_id),
        SERVER_VAR: server,  # read back by gpus (gpus.process_env)
        INSTANCE_VAR: instance,
        LAUNCH_CONFIG_VAR: json.dumps(config),
        **framework_memory_env(card, headroom_mb=headroom_mb, mode=job.memory_mode),
    }
    if job.array_index is not None:
        portal["PORTAL_ARRAY_INDEX"] = str(job.array_index)  # this task's index in its array
    env = {name: inherited[name] for name in INHERITED_ENV if name in inherited}
    if account is not None:
        env.update(HOME=account.pw_dir, USER=account.pw_name, LOGNAME=account.pw_name)
    # Defaults the job's own variables may change.
    defaults = {"TF_CPP_MIN_LOG_LEVEL": TF_LOG_LEVEL, **activation(interpreter, venv, env.get("PATH"))}
    env.update(defaults)
    env.update(job.env)
    if JAX_MEM_FRACTION in portal:
        env.pop(JAX_MEM_FRACTION_NEW, None)  # refused at submit; beside the portal's, JAX would fail
    env.update(portal)
    shown = [name for name in [*portal, *defaults] if name not in ("PATH", LAUNCH_CONFIG_VAR)]
    applied = {name: env[name] for name in sorted(shown)}
    return JobEnvironment(env=env, applied=applied, config=config)


def session_environment(
    session: InteractiveSession, card: BookedCard, *, server: str, instance: str, headroom_mb: int
) -> dict[str, str]:
    """The portal's variables for `gpu exec` and `gpu shell` on a booking: the cards and the memory
    caps a job on it gets, set over the caller's own environment by the `gpu` command.

    The TF mode is "limit and grow" on a shared card (the booking's share as TF's limit, taken as
    needed, as a notebook wants) and "grow" on whole cards: an interactive process that took every
    card's memory at its first operation would starve the next one the user starts on them.
    Threads are the user's business in their own shell, so none are set.

    Raises MigCardRefused for a booking with a card in MIG mode, as for a job.
    """
    if card.mig_uuids:
        raise MigCardRefused(mig_refusal(card.mig_uuids))
    mode = Job.MemoryMode.LIMIT_GROW if card.memory_mb is not None else Job.MemoryMode.GROW
    memory_limit, fraction = booked_memory(mode, card, headroom_mb=headroom_mb)
    config = {
        "session_id": session.pk,
        "memory_limit_mb": memory_limit,
        "allow_growth": True,
        "memory_fraction": fraction,
    }
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(session.gpu_uuids),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "PORTAL_SESSION_ID": str(session.pk),
        "PORTAL_RESERVATION_ID": str(session.reservation_id),
        SERVER_VAR: server,  # read back by gpus (gpus.process_env)
        INSTANCE_VAR: instance,
        LAUNCH_CONFIG_VAR: json.dumps(config),
        **framework_memory_env(card, headroom_mb=headroom_mb, mode=mode),
    }


def launch_config(job: Job, card: BookedCard, *, headroom_mb: int) -> dict[str, Any]:
    """The booking's settings that the launcher applies in the job's process (PORTAL_LAUNCH_CONFIG):
    TensorFlow's, and the fraction of each card for TF1 sessions and PyTorch."""
    memory_limit, fraction = booked_memory(job.memory_mode, card, headroom_mb=headroom_mb)
    return {
        "job_id": job.pk,
        "memory_limit_mb": memory_limit,
        "allow_growth": job.memory_mode in (Job.MemoryMode.GROW, Job.MemoryMode.LIMIT_GROW),
        "memory_fraction": fraction,
        "intra_op_threads": job.intra_op_threads,
        "inter_op_threads": job.inter_op_threads,
        "soft_placement": job.soft_placement,
        "log_placement": job.log_placement,
        "mirrored": job.mirrored,
    }


def activation(interpreter: str, venv: str | None, path: str | None) -> dict[str, str]:
    """PATH (and VIRTUAL_ENV) as activating the interpreter's environment would set them: its
    own folder first, so `python` and `pip` in the job are the job's interpreter's. The path as
    configured, not resolved: a venv's python is a link into the base interpreter's folder."""
    folder = posixpath.dirname(interpreter)
    path = path or DEFAULT_PATH
    if folder and path.split(":", 1)[0] != folder:
        path = f"{folder}:{path}"
    return {"PATH": path, **({"VIRTUAL_ENV": venv} if venv else {})}
