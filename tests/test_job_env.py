"""The job's environment, from its booking: `job_environment` alone, without a database or a worker.

No test here asks for the database (pytest-django would fail any query the function made), but
the one of `BookedCard.of` against a saved booking, which the runner builds before the call.
"""

from __future__ import annotations

import json
import pwd

import pytest

from gpus.booking import reservation_create
from gpus.models import GPU, Allocation
from jobs.environment import (
    LAUNCH_CONFIG_VAR,
    PORTAL_ENV,
    BookedCard,
    MigCardRefused,
    booked_memory,
    framework_memory_env,
    job_environment,
)
from jobs.host.runner import JobSetupError, launch_for
from jobs.models import Job
from jobs.submit import ScriptUpload, job_submit, parse_env
from portal.errors import Invalid

Mode = Job.MemoryMode
GB = 1024
WHOLE = BookedCard(memory_mb=None, total_mb=24 * GB, bookable_mb=23 * GB)  # 1 GB reserved + headroom
SHARED = BookedCard(memory_mb=8 * GB, total_mb=24 * GB, bookable_mb=23 * GB)
HEADROOM = 512
PYTHON = "/opt/envs/tf/bin/python"  # the job's interpreter: not the worker's
WORKER_ENV = {
    # The worker runs in the portal's activated venv.
    "PATH": "/srv/portal/.venv/bin:/opt/conda/bin:/usr/bin",
    "VIRTUAL_ENV": "/srv/portal/.venv",
    "CONDA_PREFIX": "/opt/conda",
    "HTTPS_PROXY": "http://proxy.lab:3128",
    "HOME": "/root",
    "USER": "root",
    "LANG": "C.UTF-8",
    "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
    "DATABASE_URL": "postgres://portal:pw@db/portal",
    "SECRET_KEY": "do-not-leak",
    "REDIS_URL": "redis://:pw@redis:6379/0",
    "TF_CONFIG": '{"cluster": {}}',
    "DJANGO_SETTINGS_MODULE": "portal.settings",
}


def _job(**fields) -> Job:
    fields = {
        "pk": 7,
        "reservation_id": 3,
        "gpu_uuids": ["GPU-box1-00"],
        "memory_mode": Mode.LIMIT,
        **fields,
    }
    return Job(**fields)


def _build(job: Job, card: BookedCard = SHARED, **kwargs):
    kwargs = {
        "inherited": WORKER_ENV,
        "interpreter": PYTHON,
        "server": "box1",
        "instance": "portal-a",
        "headroom_mb": HEADROOM,
        **kwargs,
    }
    return job_environment(job, card, **kwargs)


def test_it_shows_the_booked_cards_by_uuid_in_booking_order():
    built = _build(_job(gpu_uuids=["GPU-box1-03", "GPU-box1-01", "GPU-box1-02"]))
    assert built.env["CUDA_VISIBLE_DEVICES"] == "GPU-box1-03,GPU-box1-01,GPU-box1-02"
    assert built.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert (built.env["PORTAL_JOB_ID"], built.env["PORTAL_RESERVATION_ID"]) == ("7", "3")
    assert built.env["PORTAL_SERVER"] == "box1"
    # Which portal on this machine started it: the simulated backend shows no other portal's jobs.
    assert built.env["PORTAL_INSTANCE"] == "portal-a"
    assert built.env["PYTHONUNBUFFERED"] == "1"


@pytest.mark.parametrize(
    ("card", "mode", "limit", "fraction", "grow"),
    [
        # A whole card: TF may use what bookings may share (the headroom is already off it);
        # the TF1 session fraction caps the same memory, rounded down: 23/24 of the card.
        (WHOLE, Mode.LIMIT, 23 * GB, 0.958333, False),
        (WHOLE, Mode.LIMIT_GROW, 23 * GB, 0.958333, True),
        (WHOLE, Mode.GROW, None, 0.958333, True),
        (WHOLE, Mode.ALL, None, None, False),
        # A shared card: the booked 8 GB less the CUDA context's headroom, 7.5 of 24 GB.
        (SHARED, Mode.LIMIT, 8 * GB - HEADROOM, 0.3125, False),
        (SHARED, Mode.LIMIT_GROW, 8 * GB - HEADROOM, 0.3125, True),
        (SHARED, Mode.GROW, None, 0.3125, True),
    ],
)
def test_it_limits_memory_by_mode_on_whole_and_shared_cards(card, mode, limit, fraction, grow):
    built = _build(_job(memory_mode=mode), card)
    assert built.config["memory_limit_mb"] == limit
    assert built.config["memory_fraction"] == fraction
    assert built.config["allow_growth"] is grow
    assert built.env["TF_FORCE_GPU_ALLOW_GROWTH"] == ("true" if grow else "false")
    assert json.loads(built.env[LAUNCH_CONFIG_VAR]) == built.config


@pytest.mark.parametrize("total_mb", [16 * GB, 24 * GB, 40 * GB, 81559, 143771])
@pytest.mark.parametrize("booked_mb", [HEADROOM + 1, 1000, 3 * GB, 7777, 10 * GB, 15 * GB])
@pytest.mark.parametrize("mode", [Mode.LIMIT, Mode.LIMIT_GROW, Mode.GROW])
def test_it_keeps_the_context_headroom_inside_a_shared_booking_for_tf1_sessions(total_mb, booked_mb, mode):
    # TF1 sessions take fraction × the card's total, and the CUDA context comes on top of that.
    card = BookedCard(memory_mb=booked_mb, total_mb=total_mb, bookable_mb=total_mb - GB)
    limit, fraction = booked_memory(mode, card, headroom_mb=HEADROOM)
    assert 0 < fraction <= 1
    assert fraction * total_mb + HEADROOM <= booked_mb
    # The same cap as memory_limit, less at most a millionth of the card (the rounding down).
    assert booked_mb - HEADROOM - fraction * total_mb < total_mb / 10**6
    assert limit == (None if mode == Mode.GROW else booked_mb - HEADROOM)
    # JAX gets the very same fraction, as text it parses (PyTorch gets it from the launch config).
    jax = framework_memory_env(card, headroom_mb=HEADROOM, mode=mode)
    assert float(jax["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == fraction


def test_it_caps_a_whole_card_at_its_bookable_memory_and_never_leaves_a_share_uncapped():
    whole = booked_memory(Mode.LIMIT, WHOLE, headroom_mb=HEADROOM)[1]
    assert whole * WHOLE.total_mb <= WHOLE.bookable_mb  # the headroom is already off bookable memory
    # "Grow as needed" may share less than the headroom: a session still gets a cap (1 MiB), never
    # 0, which TF reads as "no cap".
    tiny = BookedCard(memory_mb=256, total_mb=24 * GB, bookable_mb=23 * GB)
    assert booked_memory(Mode.GROW, tiny, headroom_mb=HEADROOM) == (None, 0.00004)


@pytest.mark.parametrize(
    ("card", "mode", "expected"),
    [
        (
            SHARED,
            Mode.LIMIT,
            {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3125"},
        ),
        (
            SHARED,
            Mode.GROW,
            {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3125"},
        ),
        (
            WHOLE,
            Mode.LIMIT_GROW,
            {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.958333"},
        ),
        # "Take all" (whole cards only): the card is the booking's, every framework keeps its default.
        (WHOLE, Mode.ALL, {}),
    ],
)
def test_it_caps_jax_from_the_environment_by_the_booked_share(card, mode, expected):
    assert framework_memory_env(card, headroom_mb=HEADROOM, mode=mode) == expected
    built = _build(_job(memory_mode=mode), card)
    assert {name: built.env[name] for name in expected} == expected
    assert {name: built.applied[name] for name in expected} == expected  # the job's page shows them
    assert set(built.env) & {"XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION"} == set(
        expected
    )
    # PyTorch's cap is the launcher's (see framework_memory_env): the same fraction, in the launch config.
    assert built.config["memory_fraction"] == (
        float(expected["XLA_PYTHON_CLIENT_MEM_FRACTION"]) if expected else None
    )


def test_it_keeps_jaxs_newer_fraction_variable_out_beside_the_portals():
    """jaxlib refuses a process that sets XLA_CLIENT_MEM_FRACTION beside XLA_PYTHON_CLIENT_MEM_FRACTION
    (and it would take the whole card): job_submit refuses it, and a row written some other way loses it."""
    env = _build(_job(env={"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_ALLOCATOR": "bfc"})).env
    assert "XLA_CLIENT_MEM_FRACTION" not in env
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.3125"
    assert env["XLA_PYTHON_CLIENT_ALLOCATOR"] == "bfc"  # the job's own choice of allocator stays
    for name in (
        "XLA_CLIENT_MEM_FRACTION",
        "XLA_PYTHON_CLIENT_MEM_FRACTION",
        "XLA_PYTHON_CLIENT_PREALLOCATE",
    ):
        with pytest.raises(Invalid, match="set by the portal"):
            parse_env({name: "0.9"})


def test_it_leaves_the_jobs_own_pytorch_allocator_settings_as_they_are():
    """PyTorch's cap is no PYTORCH_CUDA_ALLOC_CONF key (releases before 2025 refuse an unknown one at their
    first CUDA allocation), so the job's own settings reach it untouched, and the job may set them."""
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512"}
    built = _build(_job(env=mine))
    assert built.env["PYTORCH_CUDA_ALLOC_CONF"] == mine["PYTORCH_CUDA_ALLOC_CONF"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in _build(_job()).env
    assert parse_env(mine) == mine
    assert not any("per_process_memory_fraction" in value for value in built.env.values())


def test_it_passes_the_rest_of_the_tensorflow_settings_to_the_launcher():
    job = _job(soft_placement=False, log_placement=True, mirrored=True, gpu_uuids=["GPU-a", "GPU-b"])
    config = _build(job).config
    assert config["job_id"] == 7
    assert (config["soft_placement"], config["log_placement"], config["mirrored"]) == (False, True, True)


def test_it_sets_the_thread_variables_only_when_the_job_has_threads():
    built = _build(_job(intra_op_threads=6, inter_op_threads=2))
    assert built.env["TF_NUM_INTRAOP_THREADS"] == "6"
    assert built.env["TF_NUM_INTEROP_THREADS"] == "2"
    assert built.env["OMP_NUM_THREADS"] == "6"
    assert (built.config["intra_op_threads"], built.config["inter_op_threads"]) == (6, 2)
    unset = _build(_job(intra_op_threads=None, inter_op_threads=None))
    assert not {"TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS"} & set(unset.env)
    assert (unset.config["intra_op_threads"], unset.config["inter_op_threads"]) == (None, None)


def test_it_lets_the_users_variables_in_but_never_over_the_portals():
    # job_submit refuses these; a row written some other way still cannot get past the portal.
    mine = {
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "CUDA_DEVICE_ORDER": "FASTEST_FIRST",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "TF_NUM_INTRAOP_THREADS": "64",
        "PORTAL_JOB_ID": "1",
        "PORTAL_SERVER": "elsewhere",
        "PORTAL_INSTANCE": "another-portal",
        LAUNCH_CONFIG_VAR: "{}",
        "WANDB_MODE": "offline",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    built = _build(_job(env=mine, intra_op_threads=4))
    env = built.env
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-box1-00" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "false" and env["TF_NUM_INTRAOP_THREADS"] == "4"
    assert (env["PORTAL_JOB_ID"], env["PORTAL_SERVER"], env["PORTAL_INSTANCE"]) == ("7", "box1", "portal-a")
    assert json.loads(env[LAUNCH_CONFIG_VAR]) == built.config
    assert env["WANDB_MODE"] == "offline"
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "3"  # the one portal default a user may change
    # The job's page shows what the portal set, as the job got it.
    assert built.applied["TF_CPP_MIN_LOG_LEVEL"] == "3"
    assert built.applied["CUDA_VISIBLE_DEVICES"] == "GPU-box1-00"
    assert "WANDB_MODE" not in built.applied and LAUNCH_CONFIG_VAR not in built.applied
    assert list(built.applied) == sorted(built.applied)


def test_it_never_inherits_the_workers_secrets():
    env = _build(_job()).env
    assert not {"DATABASE_URL", "SECRET_KEY", "REDIS_URL", "TF_CONFIG", "DJANGO_SETTINGS_MODULE"} & set(env)
    assert not any("do-not-leak" in value for value in env.values())
    assert (env["LANG"], env["LD_LIBRARY_PATH"]) == ("C.UTF-8", "/usr/local/cuda/lib64")
    assert env["HTTPS_PROXY"] == "http://proxy.lab:3128"  # downloads go through the lab's proxy
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "1"


def test_it_puts_the_jobs_interpreter_first_on_path_and_not_the_workers_venv():
    env = _build(_job()).env
    # As if the job's environment were activated: its `python` and `pip` come first, so `pip
    # install` in a job cannot write into the portal's venv; the worker's venv says nothing.
    assert env["PATH"] == "/opt/envs/tf/bin:/srv/portal/.venv/bin:/opt/conda/bin:/usr/bin"
    assert "VIRTUAL_ENV" not in env and "CONDA_PREFIX" not in env


def test_it_names_the_jobs_venv_only_when_given_one():
    built = _build(_job(), venv="/opt/envs/tf")
    assert built.env["VIRTUAL_ENV"] == "/opt/envs/tf"
    assert built.applied["VIRTUAL_ENV"] == "/opt/envs/tf"  # the job's page shows it
    assert "VIRTUAL_ENV" not in _build(_job(), venv=None).env


def test_it_puts_the_interpreters_folder_first_once():
    inherited = {"PATH": "/opt/envs/tf/bin:/usr/bin"}
    assert _build(_job(), inherited=inherited).env["PATH"] == "/opt/envs/tf/bin:/usr/bin"
    # A bare name (found on PATH) has no folder to add.
    assert _build(_job(), inherited={"PATH": "/usr/bin"}, interpreter="python3").env["PATH"] == "/usr/bin"


def test_it_gives_a_plain_path_when_the_worker_has_none():
    assert _build(_job(), inherited={}).env["PATH"] == "/opt/envs/tf/bin:/usr/local/bin:/usr/bin:/bin"


def test_it_sets_over_the_jobs_variables_only_what_job_submit_refuses():
    """One list of the portal's own variables: the ones the function sets over the job's own are
    PORTAL_ENV, and job_submit (parse_env) refuses every one of them. The rest it sets are defaults
    a job may change."""
    account = pwd.struct_passwd(("labjob", "x", 1500, 1500, "", "/home/labjob", "/bin/sh"))
    everything = {
        "intra_op_threads": 4,
        "inter_op_threads": 2,
        "mirrored": True,
        "gpu_uuids": ["GPU-a", "GPU-b"],
        "array_index": 3,
    }
    kwargs = {"inherited": {}, "venv": "/opt/envs/tf", "account": account}
    names = set(_build(_job(**everything), **kwargs).env)
    env = _build(_job(**everything, env=dict.fromkeys(names, "mine")), **kwargs).env
    overridden = {name for name in names if env[name] != "mine"}
    assert overridden == PORTAL_ENV
    for name in sorted(overridden):
        with pytest.raises(Invalid, match="set by the portal") as error:
            parse_env({name: "1"})
        assert error.value.field == "env"
    changeable = names - overridden
    assert changeable == {"PATH", "VIRTUAL_ENV", "TF_CPP_MIN_LOG_LEVEL", "HOME", "USER", "LOGNAME"}
    assert parse_env(dict.fromkeys(changeable, "mine")) == dict.fromkeys(changeable, "mine")


def test_it_runs_as_job_users_home_and_name():
    account = pwd.struct_passwd(("labjob", "x", 1500, 1500, "", "/home/labjob", "/bin/sh"))
    env = _build(_job(), account=account).env
    assert (env["HOME"], env["USER"], env["LOGNAME"]) == ("/home/labjob", "labjob", "labjob")
    # Without JOB_USER the job runs as the worker's user, in its HOME.
    env = _build(_job()).env
    assert (env["HOME"], env["USER"]) == ("/root", "root") and "LOGNAME" not in env


def test_it_reads_nothing_but_its_arguments(monkeypatch, settings):
    monkeypatch.setenv("LANG", "xx_XX.UTF-8")
    monkeypatch.setenv("SECRET_KEY", "from-os-environ")
    settings.WORKER_SERVER = "from-settings"
    settings.PORTAL_INSTANCE_ID = "from-settings"
    settings.GPU_CONTEXT_HEADROOM_MB = 4096
    built = _build(_job(), inherited={"PATH": "/bin"}, server="box9", instance="portal-b", headroom_mb=256)
    assert set(built.env) - set(built.applied) == {"PATH", LAUNCH_CONFIG_VAR}
    assert (built.env["PORTAL_SERVER"], built.env["PORTAL_INSTANCE"]) == ("box9", "portal-b")
    assert built.config["memory_limit_mb"] == 8 * GB - 256


def test_it_takes_a_cards_facts_from_its_allocation(settings):
    settings.GPU_CONTEXT_HEADROOM_MB = 512
    gpu = GPU(uuid="GPU-box1-00", memory_total_mb=24 * GB, memory_reserved_mb=512)
    assert BookedCard.of(Allocation(gpu=gpu, memory_mb=None)) == BookedCard(None, 24 * GB, 23 * GB)
    assert BookedCard.of(Allocation(gpu=gpu, memory_mb=4096)) == BookedCard(4096, 24 * GB, 23 * GB)


# --- MIG cards (issue 19) --------------------------------------------------------------------------


def test_a_job_is_never_given_a_mig_cards_parent_uuid():
    """CUDA on a MIG card needs an instance's MIG-... UUID, which the inventory does not know."""
    mig = BookedCard(memory_mb=None, total_mb=80 * GB, bookable_mb=79 * GB, mig_uuids=("GPU-box1-01",))
    with pytest.raises(MigCardRefused, match="MIG mode is enabled on GPU-box1-01"):
        _build(_job(gpu_uuids=["GPU-box1-00", "GPU-box1-01"]), mig)


def test_a_cards_mig_mode_comes_from_its_allocation():
    gpu = GPU(uuid="GPU-box1-00", memory_total_mb=24 * GB, memory_reserved_mb=512, mig_mode="enabled")
    assert BookedCard.of(Allocation(gpu=gpu, memory_mb=None)).mig_uuids == ("GPU-box1-00",)
    gpu.mig_mode = "disabled"
    assert BookedCard.of(Allocation(gpu=gpu, memory_mb=None)).mig_uuids == ()


@pytest.mark.django_db
def test_every_mig_card_of_the_booking_is_found(box, alice):
    booking = reservation_create(user=alice, gpus=[box[0].uuid, box[2].uuid])
    GPU.objects.filter(pk=box[2].uuid).update(mig_mode="enabled")
    first = booking.allocations.select_related("gpu").get(gpu_id=box[0].uuid)
    assert BookedCard.of(first).mig_uuids == (box[2].uuid,)


@pytest.mark.django_db
def test_the_runner_fails_a_job_on_a_mig_card_saying_why(box, alice, settings, tmp_path):
    """The refusal is a setup error: the job FAILS with the reason, never a worker traceback."""
    booking = reservation_create(user=alice, gpus=[box[0].uuid])
    job = job_submit(user=alice, reservation=booking, script=ScriptUpload(name="t.py", content=b"pass\n"))
    GPU.objects.filter(pk=box[0].uuid).update(mig_mode="enabled")
    with pytest.raises(JobSetupError, match=f"MIG mode is enabled on {box[0].uuid}"):
        launch_for(job)


def test_a_variable_name_ending_in_a_newline_is_refused():
    """`$` matches before a final newline: CUDA_VISIBLE_DEVICES\\n passed as a name of its own, and
    wrote a line of its own in a Slurm job's batch script."""
    for name in ("CUDA_VISIBLE_DEVICES\n", "MINE\n"):
        with pytest.raises(Invalid, match="is not a variable name") as error:
            parse_env({name: "0"})
        assert error.value.field == "env"
