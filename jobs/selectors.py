"""Reads of jobs: who may see which. The lists' filters are jobs.filters (pages and API)."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Q, QuerySet
from django.http import Http404

from jobs.models import Job
from portal.access import is_admin
from portal.models import Membership


def jobs_visible_to(user: AbstractBaseUser) -> QuerySet[Job]:
    """Own jobs, every job of the teams the user leads; admins see all."""
    jobs = Job.objects.select_related("owner", "team", "server")
    if is_admin(user):
        return jobs
    led = Membership.objects.filter(user=user, role=Membership.Role.LEADER).values("team_id")
    return jobs.filter(Q(owner=user) | Q(team_id__in=led))


def get_job_for_user(user: AbstractBaseUser, pk: int) -> Job:
    """The job if the user may see it; 404 otherwise (outsiders never learn it exists)."""
    job = jobs_visible_to(user).select_related("reservation").filter(pk=pk).first()
    if job is None:
        raise Http404("No such job.")
    return job
