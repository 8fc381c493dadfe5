"""Reads of jobs: who may see which, and the history filters pages and the API share."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import date, datetime, time, timedelta

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import Q, QuerySet
from django.http import Http404
from django.utils import timezone

from jobs.models import Job
from portal.access import is_admin
from portal.errors import Invalid
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


def _day(text: str, field: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise Invalid(f"{text!r} is not a date; write it as YYYY-MM-DD.", field=field) from None


def jobs_filter(jobs: QuerySet[Job], params: Mapping[str, str]) -> QuerySet[Job]:
    """?user= ?team= ?server= ?status= ?since=YYYY-MM-DD ?until=YYYY-MM-DD (both inclusive)."""
    if params.get("user"):
        jobs = jobs.filter(owner__username=params["user"])
    if params.get("team"):
        jobs = jobs.filter(team__slug=params["team"])
    if params.get("server"):
        jobs = jobs.filter(server__name=params["server"])
    if params.get("status"):
        if params["status"] not in Job.Status.values:
            raise Invalid(f"Unknown status; use one of {', '.join(Job.Status.values)}.", field="status")
        jobs = jobs.filter(status=params["status"])
    zone = timezone.get_current_timezone()
    if params.get("since"):
        since = datetime.combine(_day(params["since"], "since"), time.min, zone)
        jobs = jobs.filter(created_at__gte=since)
    if params.get("until"):
        until = datetime.combine(_day(params["until"], "until") + timedelta(days=1), time.min, zone)
        jobs = jobs.filter(created_at__lt=until)
    return jobs.order_by("-created_at", "-id")
