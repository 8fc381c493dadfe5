"""Who a job runs as: JOB_USER names one account, or @owner the job owner's Unix account."""

from __future__ import annotations

import os
import pwd

import pytest

from jobs.host.launch import JobSetupError, _job_account
from jobs.host.worker import _job_uid
from jobs.models import Job
from portal.admin import ProfileForm
from portal.models import Profile
from tests.factories import UserFactory

NOBODY = pwd.getpwnam("nobody")


@pytest.fixture
def job(alice) -> Job:
    """Only the job's owner matters here."""
    return Job(owner=alice)


def test_without_job_user_a_job_runs_as_the_worker(job, settings):
    settings.JOB_USER = ""

    assert _job_account(job) is None
    assert _job_uid(job) == os.getuid()


def test_job_user_names_one_account_for_every_job(job, settings):
    settings.JOB_USER = "nobody"

    assert _job_account(job).pw_uid == NOBODY.pw_uid


def test_at_owner_runs_the_job_as_its_owners_unix_account(job, settings):
    settings.JOB_USER = "@owner"
    Profile.objects.create(user=job.owner, unix_account="nobody")

    assert _job_account(job).pw_uid == NOBODY.pw_uid
    assert _job_uid(job) == NOBODY.pw_uid


def test_at_owner_without_a_profile_uses_the_username(db, settings):
    settings.JOB_USER = "@owner"
    job = Job(owner=UserFactory(username="nobody"))

    assert _job_account(job).pw_name == "nobody"


def test_an_owner_with_no_account_on_the_host_cannot_start(job, settings):
    settings.JOB_USER = "@owner"
    Profile.objects.create(user=job.owner, unix_account="no-such-user-here")

    with pytest.raises(JobSetupError, match="alice's Unix account 'no-such-user-here' is no account on"):
        _job_account(job)
    assert _job_uid(job) is None


@pytest.mark.parametrize("job_user", ["@owner", "root"])
def test_a_job_never_runs_as_root(job, settings, job_user):
    settings.JOB_USER = job_user
    Profile.objects.create(user=job.owner, unix_account="root")

    with pytest.raises(JobSetupError, match=r"has uid 0 .* below JOB_MIN_UID"):
        _job_account(job)


def test_at_owner_never_falls_back_to_a_username_that_is_someone_elses_unix_account(job, settings):
    """Jane's Unix account is "nobody": a portal user named "nobody" must not run as her."""
    settings.JOB_USER = "@owner"
    Profile.objects.create(user=UserFactory(username="jane"), unix_account="nobody")
    job = Job(owner=UserFactory(username="nobody"))

    with pytest.raises(JobSetupError, match="nobody has no Unix account the portal can vouch for"):
        _job_account(job)
    assert _job_uid(job) is None


@pytest.mark.parametrize(
    ("typed", "valid", "stored"), [(" asmith ", True, "asmith"), ("", True, None), ("a smith", False, None)]
)
def test_admins_set_only_a_name_the_hosts_can_have(db, typed, valid, stored):
    form = ProfileForm(data={"unix_account": typed})

    assert form.is_valid() == valid
    if valid:
        assert form.cleaned_data["unix_account"] == stored
    else:
        assert "Unix account: a login name on the GPU hosts" in str(form.errors)
