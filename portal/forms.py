"""What every form shares: putting a service's refusal beside the field it names; and portal's own
form, the profile's mail preferences.

The other forms live with their app (gpus/forms.py, gpus/team_forms.py, jobs/forms.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from html import escape
from typing import Any

from django import forms
from django.utils.html import conditional_escape
from django.utils.safestring import SafeString, mark_safe

from portal.errors import ServiceError
from portal.models import Membership, Notification
from portal.time_zones import zone_choices

# Django's and DRF's words for a bad number or choice ("Ensure this value is greater than or equal
# to 1.", "A valid integer is required.", "Select a valid choice.") name no fix: these do, shared
# by the web forms and the API's serializers that take the same fields.
CARDS_ERRORS = {
    "invalid": "Give how many cards as a whole number, e.g. 2.",
    "min_value": "Ask for 1 card or more.",
    "max_value": "Ask for %(limit_value)s cards at most.",
}
MIB_ERRORS = {
    "invalid": "Give MiB per card as a whole number, e.g. 16384 for 16 GiB; leave it out for whole cards.",
}
SERVER_ERRORS = {
    "invalid_choice": "There is no server %(value)s; pick one of the list, or leave it empty for any.",
}


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


class ManyOptionsSelect(forms.Select):
    """A select of hundreds of options (the ~600 time zones), its options written here rather than
    by Django's templates, which render each option through an include of its own: the time zone
    field was 250 ms of the profile page's 280 ms on a slow VM. The same HTML as forms.Select's
    (tests/test_time_zones.py compares them); a choice list with groups is left to Django's."""

    def render(
        self, name: str, value: Any, attrs: dict[str, Any] | None = None, renderer: Any = None
    ) -> SafeString:
        choices = list(self.choices)
        if any(isinstance(label, list | tuple) for _value, label in choices):
            return super().render(name, value, attrs, renderer)
        chosen = set(self.format_value(value))
        return mark_safe(  # every attribute, value and label escaped below
            f'<select name="{escape(name)}"{_attrs(self.build_attrs(self.attrs, attrs))}>'
            f"{_options(choices, chosen)}</select>"
        )


def _attrs(attrs: dict[str, Any]) -> str:
    """As django/forms/widgets/attrs.html writes them: in their order, True bare, False left out."""
    return "".join(
        f" {escape(str(key))}" if value is True else f' {escape(str(key))}="{escape(str(value))}"'
        for key, value in attrs.items()
        if value is not False
    )


def _options(choices: Iterable[tuple[Any, Any]], chosen: set[str]) -> str:
    """Each value escaped, and each label unless it is safe already, as Django's templates do; a
    format_html for each option was still 20 ms for the zones. As Django's, only the first option
    of a chosen value is selected."""
    written, has_selected = [], False
    for value, label in choices:
        selected = not has_selected and str(value) in chosen
        has_selected = has_selected or selected
        mark = " selected" if selected else ""
        written.append(f'<option value="{escape(str(value))}"{mark}>{conditional_escape(label)}</option>')
    return "".join(written)


class TimeZoneForm(ServiceErrorsMixin, forms.Form):
    time_zone = forms.ChoiceField(
        choices=zone_choices,
        widget=ManyOptionsSelect,
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
