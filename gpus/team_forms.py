"""Quota forms for the team page. They only parse numbers; the rules (who may, within the team's
limits) are in gpus/quotas.py, whose errors the views put beside the field they name.
"""

from __future__ import annotations

from typing import Any

from django import forms

from gpus.quotas import QUOTA_MAX
from portal.forms import ServiceErrorsMixin
from portal.models import Membership, QuotaFields, Team


def _limit_field(
    model: type[QuotaFields], name: str, label: str, unit: str, note: str = ""
) -> forms.IntegerField:
    # max_value well inside PositiveIntegerField's range, so a typo never reaches the database
    # as an overflow.
    return forms.IntegerField(
        required=False,
        min_value=0,
        max_value=QUOTA_MAX,
        label=label,
        help_text=f"{model._meta.get_field(name).help_text} {note}".strip(),
        error_messages={
            "invalid": f"Enter a whole number of {unit}, e.g. 4, or leave it empty for no limit.",
            "min_value": "Enter 0 or more (0 allows none), or leave it empty for no limit.",
            "max_value": f"Enter at most {QUOTA_MAX:,}, or leave it empty for no limit.",
        },
    )


class QuotaForm(ServiceErrorsMixin, forms.Form):
    """Empty fields mean "no limit" (None). `limits()` is what the service takes."""

    def limits(self) -> dict[str, int | None]:
        return {name: self.cleaned_data[name] for name in self.fields}


class TeamQuotaForm(QuotaForm):
    max_cards = _limit_field(Team, "max_cards", "Cards at once", "cards")
    max_gb = _limit_field(Team, "max_gb", "GB at once", "GB")
    gpu_hours_per_week = _limit_field(Team, "gpu_hours_per_week", "GPU-hours per week", "GPU-hours")

    @classmethod
    def for_team(cls, team: Team, data: Any = None) -> TeamQuotaForm:
        return cls(data, initial={name: getattr(team, name) for name in cls.base_fields})


TEAM_STILL_APPLIES = "At most the team's own limit, which applies as well."


class MemberQuotaForm(QuotaForm):
    max_cards = _limit_field(Membership, "max_cards", "Cards at once", "cards", TEAM_STILL_APPLIES)
    max_gb = _limit_field(Membership, "max_gb", "GB at once", "GB", TEAM_STILL_APPLIES)
    gpu_hours_per_week = _limit_field(
        Membership, "gpu_hours_per_week", "GPU-hours per week", "GPU-hours", TEAM_STILL_APPLIES
    )
    max_booking_hours = _limit_field(Membership, "max_booking_hours", "Longest booking (hours)", "hours")

    @classmethod
    def for_membership(cls, membership: Membership, data: Any = None) -> MemberQuotaForm:
        """One form per member on the team page: ids carry the membership so they stay unique."""
        return cls(
            data,
            initial={name: getattr(membership, name) for name in cls.base_fields},
            auto_id=f"id_m{membership.pk}_%s",
        )
