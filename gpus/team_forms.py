"""Forms for the team page: quotas and the auto-release of idle bookings. They only parse values;
the rules (who may, within the team's limits) are in gpus/quotas.py and gpus/idle.py, whose errors
the views put beside the field they name.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.utils.text import capfirst

from gpus.quotas import QUOTA_MAX
from portal.forms import ServiceErrorsMixin
from portal.models import Membership, QuotaFields, Team


def _label(model: type[QuotaFields], name: str) -> str:
    """The model's verbose name: one label for a limit, here, in messages and in /admin/."""
    return capfirst(str(model._meta.get_field(name).verbose_name))


def _limit_field(model: type[QuotaFields], name: str, unit: str, note: str = "") -> forms.IntegerField:
    # max_value well inside PositiveIntegerField's range, so a typo never reaches the database
    # as an overflow.
    return forms.IntegerField(
        required=False,
        min_value=0,
        max_value=QUOTA_MAX,
        label=_label(model, name),
        help_text=f"{model._meta.get_field(name).help_text} {note}".strip(),
        error_messages={
            "invalid": f"Enter a whole number of {unit}, e.g. 4, or leave it empty for no limit.",
            "min_value": "Enter 0 or more (0 allows none), or leave it empty for no limit.",
            "max_value": f"Enter at most {QUOTA_MAX:,}, or leave it empty for no limit.",
        },
    )


def _shares_field(model: type[QuotaFields]) -> forms.IntegerField:
    """Fair-share shares: never "no limit", so an empty field leaves them as they are."""
    return forms.IntegerField(
        required=False,
        min_value=1,
        max_value=QUOTA_MAX,
        label=_label(model, "shares"),
        help_text=model._meta.get_field("shares").help_text,
    )


class QuotaForm(ServiceErrorsMixin, forms.Form):
    """Empty fields mean "no limit" (None). `limits()` is what the service takes."""

    def limits(self) -> dict[str, int | None]:
        # Shares are never "no limit": an empty field leaves them as they are.
        return {
            name: value
            for name, value in self.cleaned_data.items()
            if name in self.fields and not (name == "shares" and value is None)
        }


class TeamQuotaForm(QuotaForm):
    max_cards = _limit_field(Team, "max_cards", "cards")
    max_gb = _limit_field(Team, "max_gb", "GiB")
    gpu_hours_per_week = _limit_field(Team, "gpu_hours_per_week", "GPU-hours")
    shares = _shares_field(Team)

    @classmethod
    def for_team(cls, team: Team, data: Any = None) -> TeamQuotaForm:
        return cls(data, initial={name: getattr(team, name) for name in cls.base_fields})


TEAM_STILL_APPLIES = "At most the team's own limit, which applies as well."


class MemberQuotaForm(QuotaForm):
    max_cards = _limit_field(Membership, "max_cards", "cards", TEAM_STILL_APPLIES)
    max_gb = _limit_field(Membership, "max_gb", "GiB", TEAM_STILL_APPLIES)
    gpu_hours_per_week = _limit_field(Membership, "gpu_hours_per_week", "GPU-hours", TEAM_STILL_APPLIES)
    max_booking_hours = _limit_field(Membership, "max_booking_hours", "hours")
    shares = _shares_field(Membership)

    @classmethod
    def for_membership(cls, membership: Membership, data: Any = None) -> MemberQuotaForm:
        """One form per member on the team page: ids carry the membership so they stay unique."""
        return cls(
            data,
            initial={name: getattr(membership, name) for name in cls.base_fields},
            auto_id=f"id_m{membership.pk}_%s",
        )


class AutoReleaseForm(forms.Form):
    """The team's auto-release of idle bookings (gpus/idle.py has the rule and the service)."""

    auto_release_idle = forms.BooleanField(required=False, label="Release idle bookings automatically")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["auto_release_idle"].help_text = (
            f"A booking whose cards stay idle for {settings.IDLE_WARN_MINUTES} minutes warns its owner. "
            f"With this on, it is released {settings.IDLE_RELEASE_MINUTES} minutes after the warning "
            "unless its cards are used, and the owner is told; a booking unused from its start for "
            f"{settings.NO_SHOW_MINUTES} minutes (a no-show) is released at once. "
            "Off: owners are only warned."
        )

    @classmethod
    def for_team(cls, team: Team, data: Any = None) -> AutoReleaseForm:
        return cls(data, initial={"auto_release_idle": team.auto_release_idle})


class LendIdleForm(forms.Form):
    """The team's lending of idle bookings to the queue (jobs/lending.py lends; gpus/idle.py sets it)."""

    lend_idle = forms.BooleanField(required=False, label="Lend idle bookings to the queue")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["lend_idle"].help_text = (
            f"A booking idle for {settings.LEND_AFTER_MINUTES} minutes may run preemptible queued jobs on "
            "its cards; they leave as soon as its owner starts something there (within "
            f"{settings.LEND_GRACE_SECONDS} s), or presses Take it back. Off: never lent."
        )

    @classmethod
    def for_team(cls, team: Team, data: Any = None) -> LendIdleForm:
        return cls(data, initial={"lend_idle": team.lend_idle})
