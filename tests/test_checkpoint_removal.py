"""A checkpoint folder's removal by the worker (jobs/host/checkpoints.py, jobs.host.folders.
job_folder_remove). The folder is the job's account's, and that account may have a shell on the
host: whatever it leaves there, or swaps in while the worker walks it, is hostile."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from jobs.host.checkpoints import CHECKPOINT_VAR, checkpoint_ready, checkpoint_remove
from jobs.host.launch import Launch
from jobs.models import Job
from tests.factories import queue_job
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db


def _folder(job: Job) -> Path:
    launch = Launch(argv=["python"], env={"PATH": "/bin"}, cwd=Path("/tmp"), env_applied={}, account=None)
    return Path(checkpoint_ready(launch, job).env[CHECKPOINT_VAR])


def test_what_its_owner_planted_goes_and_nothing_it_points_to(alice, box, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("someone else's")
    job = queue_job(alice, preemptible=True)
    folder = _folder(job)
    (folder / "nested" / "deeper").mkdir(parents=True)
    (folder / "nested" / "deeper" / "state").write_text("epoch 3")
    (folder / "dir-link").symlink_to(outside)
    (folder / "nested" / "file-link").symlink_to(outside / "keep")
    os.link(outside / "keep", folder / "hard-link")
    os.mkfifo(folder / "nested" / "fifo")

    assert checkpoint_remove(job)
    assert not folder.exists()
    assert (outside / "keep").read_text() == "someone else's" and os.stat(outside / "keep").st_nlink == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a folder to another account: needs root")
def test_a_folder_of_another_account_moved_in_is_never_emptied(alice, box, caplog):
    """Its owner moved in a folder of someone else's (from a group-writable folder on the same
    disk): its contents are not theirs to remove, so not the worker's either; left for an admin."""
    job = queue_job(alice, preemptible=True)
    folder = _folder(job)
    theirs = folder / "moved-in" / "results"
    theirs.mkdir(parents=True)
    (theirs / "model.h5").write_text("someone else's")
    os.chown(folder / "moved-in", 54321, 54321)
    (folder / "state").write_text("epoch 3")

    assert not checkpoint_remove(job)
    assert (theirs / "model.h5").read_text() == "someone else's"
    assert "moved-in, a folder of uid 54321" in caplog.text


def test_a_tree_its_owner_made_deep_is_removed_whole(alice, box):
    """Deeper than Python's recursion limit: removed all the same, with a few descriptors."""
    job = queue_job(alice, preemptible=True)
    folder = _folder(job)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1500):
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)

    assert checkpoint_remove(job)
    assert not folder.exists()


def test_a_fifo_swapped_in_for_a_folder_mid_walk_is_never_opened(alice, box, monkeypatch, tmp_path):
    """Its owner replaces a folder the walk has listed by a link to a FIFO (or a device: opening
    /dev/watchdog as root arms it) just before the walk enters it: the link goes, unopened, and
    the walk never blocks."""
    job = queue_job(alice, preemptible=True)
    folder = _folder(job)
    (folder / "sub").mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real_open, swapped = os.open, []

    def swapping_open(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if path == "sub" and not swapped:  # the owner's move, between the listing and the open
            os.rmdir(folder / "sub")
            os.symlink(fifo, folder / "sub")
            swapped.append(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", swapping_open)
    removed: list[bool] = []
    walk = threading.Thread(target=lambda: removed.append(checkpoint_remove(job)), daemon=True)
    walk.start()
    try:
        wait_for(lambda: not walk.is_alive(), timeout=5, what="the removal to return")
    finally:
        if walk.is_alive():  # blocked in the FIFO's open: a writer lets it go
            os.close(real_open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            walk.join(timeout=5)
    assert swapped and removed == [True]
    assert not folder.exists() and fifo.exists()
