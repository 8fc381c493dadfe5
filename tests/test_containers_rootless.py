"""Rootless mode (CONTAINER_MODE=rootless, jobs/host/rootless.py) without a runtime: what the host
says when an account cannot run containers, the folders kept for each account, the argv. The
real runs are tests/test_containers.py's [rootless] cases."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile

import pytest

from jobs.host import containers, rootless
from jobs.host.containers import local_name
from jobs.host.executors.base import ImageSpec, RunSpec
from jobs.host.executors.podman_args import run_argv

# An account in no /etc/subuid (a uid no test machine gives a range to).
STRANGER = pwd.struct_passwd(
    ("portal-no-subids", "x", 4_000_000_001, 4_000_000_001, "", "/nonexistent", "/bin/sh")
)


@pytest.fixture
def rootless_mode(settings, tmp_path):
    settings.CONTAINER_MODE = "rootless"
    settings.CONTAINER_ROOTLESS_STORAGE_DIR = str(tmp_path / "storage")
    short = tempfile.mkdtemp(prefix="prl-")  # a run root must stay short (rootless.RUN_ROOT_MAX)
    settings.CONTAINER_ROOTLESS_RUN_DIR = short
    yield settings
    shutil.rmtree(short, ignore_errors=True)


def test_an_account_without_subordinate_ids_is_reported_with_the_fix(rootless_mode):
    ok, detail = containers.account_status(STRANGER)
    assert not ok
    assert "portal-no-subids has no range in /etc/subuid" in detail
    assert "usermod --add-subuids" in detail


def test_rootless_mode_needs_a_job_account(rootless_mode, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("the check before this one says the worker must run as root")
    rootless_mode.JOB_USER = ""
    monkeypatch.setattr(containers.shutil, "which", lambda name, path=None: f"/usr/bin/{name}")
    ok, detail = containers._runtime_check()
    assert not ok and "needs JOB_USER" in detail


def test_subordinate_ids_are_read_by_name_or_by_uid(tmp_path):
    listed = tmp_path / "subuid"
    listed.write_text("portal-no-subids:100000:65536\n4000000001:200000:1000\nother:300000:65536\n")
    assert rootless.subid_ranges(STRANGER, str(listed)) == 66536
    assert rootless.subid_ranges(STRANGER, str(tmp_path / "missing")) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the folders are chowned to the account: needs root")
def test_each_account_gets_folders_of_its_own_that_others_cannot_list(rootless_mode):
    nobody = pwd.getpwnam("nobody")
    folder = rootless.storage_dir(nobody)
    found = folder.stat()
    assert (found.st_uid, stat.S_IMODE(found.st_mode)) == (nobody.pw_uid, 0o700)
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o711
    assert rootless.run_dir(nobody).stat().st_uid == nobody.pw_uid


def test_a_run_folder_too_long_for_podman_is_refused_naming_the_setting(rootless_mode):
    rootless_mode.CONTAINER_ROOTLESS_RUN_DIR = "/run/" + "x" * 40
    with pytest.raises(rootless.AccountError, match=r"CONTAINER_ROOTLESS_RUN_DIR .* too long"):
        rootless.run_dir(pwd.getpwnam("nobody"))


def test_rootless_runs_keep_the_accounts_uid_and_a_folder_image_by_its_imported_name(tmp_path, settings):
    settings.CONTAINER_CDI_DIRS = [str(tmp_path / "cdi")]
    nobody = pwd.getpwnam("nobody")
    spec = RunSpec(
        ["python3", "job.py"], {}, "/work", "Job 1", nobody, image=ImageSpec("tf", "/srv/images/tf")
    )
    argv = run_argv(spec, "portal-x-job-1", tmp_path, rootless=True)
    assert argv[argv.index("--userns") + 1] == "keep-id"
    assert "--rootfs" not in argv
    assert argv[-3:] == [local_name("/srv/images/tf", nobody), "python3", "job.py"]
    assert local_name("/srv/images/tf", nobody).startswith("localhost/portal-rootfs-")
    assert "--userns" not in run_argv(spec, "portal-x-job-1", tmp_path)
