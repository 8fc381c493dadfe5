from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.db.models import QuerySet
from django.http import HttpRequest
from rest_framework.authtoken.models import TokenProxy

from portal.errors import Invalid
from portal.identity import unix_account_claim_confirm, unix_account_valid
from portal.models import (
    NESTED_LIMITS,
    ApiToken,
    AuditEntry,
    ChannelDelivery,
    ExternalAccount,
    Membership,
    Notification,
    NotificationChannel,
    Profile,
    Team,
    members_above_team,
)
from portal.services import api_token_revoke, signin_unlock
from portal.teams import team_locked_with_members


class ProfileForm(forms.ModelForm):
    class Meta:
        model = Profile
        fields = ["unix_account"]

    def clean_unix_account(self) -> str | None:
        # Jobs may run as it (JOB_USER=@owner) and the watchdog names people by it: a name the
        # hosts cannot have would only ever fail, or match something it should not.
        name = (self.cleaned_data["unix_account"] or "").strip()
        if name and not unix_account_valid(name):
            raise forms.ValidationError(
                "Unix account: a login name on the GPU hosts, e.g. asmith: letters, digits, '.', '_'"
                " and '-', starting with a letter or '_', at most 32 characters."
            )
        return name or None

    def clean(self) -> dict:
        cleaned = super().clean()
        # Given by hand what their directory claims: the claim is settled.
        if cleaned.get("unix_account") and cleaned["unix_account"] == self.instance.unix_account_claim:
            self.instance.unix_account_claim = None
        return cleaned


class ProfileInline(admin.StackedInline):
    """The Unix account, and the one their directory claims from a source not trusted for it: an
    admin confirms that with the action "Confirm claimed Unix account" (docs/identity.md)."""

    model = Profile
    form = ProfileForm
    can_delete = False
    fields = ["unix_account", "unix_account_claim"]
    readonly_fields = ["unix_account_claim"]


class ExternalAccountInline(admin.TabularInline):
    """The directory accounts that sign in as this user. Adding one links an account the sign-in
    rules will not link on their own (an admin's, say: docs/identity.md); deleting one unlinks."""

    model = ExternalAccount
    extra = 0
    fields = ["source", "issuer", "subject", "created_at", "last_login_at"]
    readonly_fields = ["created_at", "last_login_at"]


User = get_user_model()
admin.site.unregister(User)
# DRF's plaintext tokens: emptied by portal 0008, and a token added there would not work.
admin.site.unregister(TokenProxy)


@admin.register(User)
class PortalUserAdmin(UserAdmin):
    """Django's user admin, with the Unix account the GPU watchdog maps processes by (and the
    action that confirms one a directory claims), and the action that lifts a sign-in lock
    (django-axes; a locked address: Axes → Access attempts)."""

    inlines = [*UserAdmin.inlines, ProfileInline, ExternalAccountInline]
    actions = [*UserAdmin.actions, "unlock_signin", "confirm_unix_account_claim"]
    list_display = [*UserAdmin.list_display, "unix_account_claim"]
    list_filter = [*UserAdmin.list_filter, ("profile__unix_account_claim", admin.EmptyFieldListFilter)]
    list_select_related = ["profile"]

    @admin.display(description="Claimed Unix account (to confirm)")
    def unix_account_claim(self, user) -> str | None:  # type: ignore[no-untyped-def]
        profile = getattr(user, "profile", None)
        return profile.unix_account_claim if profile else None

    def has_unix_account_permission(self, request: HttpRequest) -> bool:
        """What giving a Unix account by hand takes (the profile inline on the change form): jobs
        run as that account (JOB_USER=@owner) and the watchdog blames processes on it."""
        return self.has_change_permission(request) and request.user.has_perm("portal.change_profile")

    @admin.action(description="Confirm claimed Unix account", permissions=["unix_account"])
    def confirm_unix_account_claim(self, request: HttpRequest, queryset: QuerySet) -> None:
        for user in queryset:
            try:
                name = unix_account_claim_confirm(user=user, by=request.user)
            except Invalid as exc:
                self.message_user(request, exc.message, messages.WARNING)
            else:
                self.message_user(
                    request, f"Confirmed: {user}'s Unix account is now {name}.", messages.SUCCESS
                )

    @admin.action(description="Unlock sign-in (clear failed logins)", permissions=["change"])
    def unlock_signin(self, request: HttpRequest, queryset: QuerySet) -> None:
        cleared = sum(signin_unlock(user=user, by=request.user) for user in queryset)
        self.message_user(
            request,
            f"Sign-in unlocked for {queryset.count()} user(s); {cleared} failed-login record(s) cleared.",
            messages.SUCCESS,
        )


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Read-only but for revoking: a token's key exists only where it was shown, once."""

    list_display = ["name", "user", "prefix", "created_at", "last_used_at", "ends_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["name", "prefix", "user__username"]
    readonly_fields = [field.name for field in ApiToken._meta.fields]
    actions = ["revoke"]

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_revoke_permission(self, request: HttpRequest) -> bool:
        """The model's change permission, which the admin's form never uses (it is read-only)."""
        return request.user.has_perm("portal.change_apitoken")

    @admin.action(description="Revoke the selected tokens", permissions=["revoke"])
    def revoke(self, request: HttpRequest, queryset: QuerySet) -> None:
        revoked = sum(
            api_token_revoke(token=token, by=request.user) for token in queryset.select_related("user")
        )
        self.message_user(request, f"{revoked} token(s) revoked.", messages.SUCCESS)


class MembershipFormSet(forms.BaseInlineFormSet):
    """A team's members on its admin page, checked against the team's limits as submitted with
    them (portal.models.members_above_team, the team page's rule): a team quota set below a
    member's, or a member's above the team's, is refused, naming them; nothing is saved."""

    def clean(self) -> None:
        super().clean()
        team = {field: getattr(self.instance, field) for field in NESTED_LIMITS}
        members = [
            (data["user"].username, data)
            for data in (getattr(form, "cleaned_data", None) or {} for form in self.forms)
            if data.get("user") and not data.get("DELETE")
        ]
        above = members_above_team(team, members)
        if above:
            raise forms.ValidationError(list(above.values()))


class MembershipInline(admin.TabularInline):
    model = Membership
    formset = MembershipFormSet
    extra = 1
    autocomplete_fields = ["user"]
    fields = ["user", "role", "max_cards", "max_gb", "max_booking_hours", "gpu_hours_per_week", "shares"]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    """Quota edits here bypass the audit log: use the team page for changes that should be logged."""

    list_display = ["name", "slug", "max_cards", "max_gb", "gpu_hours_per_week"]
    prepopulated_fields = {"slug": ["name"]}
    search_fields = ["name"]
    inlines = [MembershipInline]

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Team | None:
        """On a POST, the team's row locked (changeform_view and delete_view run in a transaction)
        and read again, before the members are checked against its limits: as quota_team_set and
        quota_member_set lock it, so a member's quota set on the team page meanwhile cannot slip
        past this form's check (MembershipFormSet), nor this save past theirs. Its members' rows
        are locked first, in the order bookings take them (team_locked_with_members): the other
        way round, a booking holding a member's row and waiting for the team's deadlocked with
        this form's save of that member."""
        team = super().get_object(request, object_id, from_field)
        if team is None or request.method != "POST":
            return team
        return team_locked_with_members(team.pk)


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ["at", "actor", "team", "action", "message"]
    list_filter = ["action", "team"]
    search_fields = ["message", "actor__username", "target"]
    readonly_fields = ["at", "actor", "team", "action", "target", "message", "data"]

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False


@admin.register(Notification)
class NotificationAdmin(admin.ModelAdmin):
    """Read-only: what was sent, and what became of its mail (why someone got none)."""

    list_display = ["created_at", "user", "kind", "subject", "read_at", "mail_status", "mailed_at"]
    list_filter = ["kind", "mail_status"]
    search_fields = ["subject", "user__username", "key"]
    readonly_fields = [field.name for field in Notification._meta.fields]

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False


@admin.register(NotificationChannel)
class NotificationChannelAdmin(admin.ModelAdmin):
    """Seen and deleted here, never changed: the URL is a secret (stored encrypted, shown masked);
    its owner adds a channel on their profile or the team's page (portal.channels)."""

    list_display = ["__str__", "user", "team", "url_masked", "last_sent_at", "last_error"]
    list_filter = ["team"]
    search_fields = ["label", "user__username", "team__slug"]
    exclude = ["url_encrypted"]
    readonly_fields = [f.name for f in NotificationChannel._meta.fields if f.name != "url_encrypted"]

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False


@admin.register(ChannelDelivery)
class ChannelDeliveryAdmin(admin.ModelAdmin):
    """What went to which channel, and what became of it: read-only (the row is the record)."""

    list_display = ["created_at", "channel", "kind", "subject", "status", "attempts", "sent_at"]
    list_filter = ["status", "kind"]
    readonly_fields = [f.name for f in ChannelDelivery._meta.fields]

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False
