"""What every form shares: putting a service's refusal beside the field it names; and portal's own
form, the profile's mail preferences.

The other forms live with their app (gpus/forms.py, gpus/team_forms.py, jobs/forms.py).
"""

from __future__ import annotations

from django import forms

from portal.errors import ServiceError
from portal.models import Membership, Notification
from portal.time_zones import zone_choices


class ServiceErrorsMixin:
    """For every form whose data goes to a service: the service's refusal (a ServiceError)
    goes beside the field it names, or above the form when the form has no such field."""

    # Service argument names that the form spells differently (e.g. memory_mb → memory).
    service_fields: dict[str, str] = {}

    def add_service_error(self, error: ServiceError) -> None:
        """Each message beside its field (every one a service reported at once: portal.errors.Errors)."""
        for field, messages in (error.errors or {error.field or "": [error.message]}).items():
            name = self.service_fields.get(field or "", field)
            for message in messages:
                self.add_error(name if name in self.fields else None, message)  # type: ignore[attr-defined]


class TimeZoneForm(ServiceErrorsMixin, forms.Form):
    time_zone = forms.ChoiceField(
        choices=zone_choices,
        required=False,
        label="Show and read times in",
        help_text="Empty: your browser's.",
    )


class JobNotifyForm(forms.Form):
    """What a person is told of their jobs (jobs.notices); a job's own choice wins."""

    events = forms.MultipleChoiceField(
        choices=[
            ("start", "A queued job of mine started"),
            ("end", "A job of mine succeeded (one that ran at least the minutes below)"),
            ("fail", "A job of mine failed, timed out or was lost"),
        ],
        widget=forms.CheckboxSelectMultiple,
        required=False,
        label="Tell me when",
        help_text="A job array is told once, when all its tasks are done. A job's own choice (the job "
        "form's “Tell me”, gpu run --notify) wins over these.",
    )


class MailPreferenceForm(forms.Form):
    """Which kinds of notification come by mail too (every kind is in the inbox)."""

    kinds = forms.MultipleChoiceField(
        choices=Notification.Kind.choices,
        widget=forms.CheckboxSelectMultiple,
        required=False,
        label="Mail me about",
        help_text="Unticked kinds still appear in your inbox.",
    )


def _usernames(value: str) -> list[str]:
    """ "bob, carol dave" → [bob, carol, dave]: commas or blanks between usernames."""
    return [name for name in value.replace(",", " ").split() if name]


class TeamCreateForm(ServiceErrorsMixin, forms.Form):
    """A new team (admins; portal.teams.team_create checks the names and the people)."""

    name = forms.CharField(
        max_length=100,
        help_text="As people see it, e.g. Vision Lab.",
        error_messages={"required": "Give the team a name, e.g. Vision Lab."},
    )
    slug = forms.CharField(
        max_length=100,
        required=False,
        help_text="Its short name in URLs, e.g. vision-lab. Empty: from the name.",
    )
    leaders = forms.CharField(
        required=False,
        help_text="Usernames, separated by commas: they set members' quotas and see the team's jobs.",
    )
    members = forms.CharField(required=False, help_text="Usernames, separated by commas.")

    def clean_leaders(self) -> list[str]:
        return _usernames(self.cleaned_data["leaders"])

    def clean_members(self) -> list[str]:
        return _usernames(self.cleaned_data["members"])


class MemberAddForm(ServiceErrorsMixin, forms.Form):
    """Someone added to a team (admins; portal.teams.team_member_add)."""

    username = forms.CharField(max_length=150, help_text="Their portal username.")
    role = forms.ChoiceField(choices=Membership.Role.choices, initial=Membership.Role.MEMBER)
