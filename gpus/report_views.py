"""The Reports page and its CSV export: usage from the rollups (gpus/usage.py), through the one
UsageFilter that /api/v1/usage/ uses too, so the page, the file and the API never disagree.

Everyone sees their own usage; leaders their teams'; admins everything (gpus.reports.UsageScope).
A bad filter value is shown beside its field with an empty report, never the unfiltered one; the
CSV answers it with a 400 that says what to write.
"""

from __future__ import annotations

import csv
from datetime import date, timedelta

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import render
from django.urls import reverse
from django.utils.http import content_disposition_header
from django.views.decorators.http import require_GET

from gpus.filters import USAGE_GROUPS, UsageFilter
from gpus.models import UsageDay
from gpus.reports import COLUMNS, UsageScope, usage_queryset, usage_report, usage_rows
from gpus.usage import portal_today


def _filters(request: HttpRequest) -> UsageFilter:
    return UsageFilter(request.GET, queryset=UsageDay.objects.none(), request=request)


@require_GET
@login_required
def reports(request: HttpRequest) -> HttpResponse:
    filters = _filters(request)
    presets = _presets(filters, portal_today())
    context: dict[str, object] = {"filter_form": filters.form, "presets": presets}
    if filters.is_valid():
        context["report"] = usage_report(filters, UsageScope.of(request.user))
        context["group_label"] = dict(USAGE_GROUPS)[filters.grouping]
        context["csv_url"] = f"{reverse('reports_csv')}?{filters.data.urlencode()}"
    return render(request, "gpus/reports.html", context)


@require_GET
@login_required
def reports_csv(request: HttpRequest) -> HttpResponse:
    """The page's table as CSV: the same filters and group_by, every figure."""
    filters = _filters(request)
    if not filters.is_valid():
        problems = "; ".join(f"{name}: {' '.join(errors)}" for name, errors in filters.errors.items())
        return HttpResponseBadRequest(f"Not exported: {problems}\n", content_type="text/plain; charset=utf-8")
    group_by = filters.grouping
    visible = usage_queryset(UsageScope.of(request.user), group_by)
    rows = usage_rows(filters.filter_queryset(visible), group_by)
    since, until = filters.form.cleaned_data["since"], filters.form.cleaned_data["until"]
    name = f"usage-{since or 'start'}-{until or portal_today()}-by-{group_by}.csv"
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = content_disposition_header(as_attachment=True, filename=name)
    writer = csv.writer(response)
    writer.writerow(COLUMNS)
    writer.writerows([row[column] for column in COLUMNS] for row in rows)
    return response


def _presets(filters: UsageFilter, today: date) -> list[tuple[str, str, bool]]:
    """The period picker: (label, URL, current), each keeping the other filters; `today` is the
    portal's, as the usage tables' days are: "This week" is the weekly quota's week."""
    month = today.replace(day=1)
    last_month_end = month - timedelta(days=1)
    periods = [
        ("This month", month, None),
        ("Last month", last_month_end.replace(day=1), last_month_end),
        ("This week", today - timedelta(days=today.weekday()), None),
        ("Last 30 days", today - timedelta(days=29), None),
        ("This year", today.replace(month=1, day=1), None),
    ]
    presets = []
    for label, since, until in periods:
        params = filters.data.copy()
        params["since"] = since.isoformat()
        params["until"] = until.isoformat() if until else ""
        current = (filters.data.get("since"), filters.data.get("until") or "") == (
            params["since"],
            params["until"],
        )
        presets.append((label, f"?{params.urlencode()}", current))
    return presets
