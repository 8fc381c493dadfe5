from django.contrib import admin

from portal.models import AuditEntry, Membership, Team


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 1
    autocomplete_fields = ["user"]
    fields = ["user", "role", "max_cards", "max_gb", "max_booking_hours", "gpu_hours_per_week"]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    """Quota edits here bypass the audit log: use the team page for changes that should be logged."""

    list_display = ["name", "slug", "max_cards", "max_gb", "gpu_hours_per_week"]
    prepopulated_fields = {"slug": ["name"]}
    search_fields = ["name"]
    inlines = [MembershipInline]


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
