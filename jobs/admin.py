from django.contrib import admin

from jobs.models import Job


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    """Read-mostly: status changes go through the services (cancel on the job page)."""

    list_display = ["id", "name", "owner", "team", "server", "status", "created_at", "exit_code"]
    list_filter = ["status", "server", "team"]
    search_fields = ["name", "owner__username", "script_path"]
    readonly_fields = [f.name for f in Job._meta.fields if f.name != "script_source"]
    exclude = ["script_source"]

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False
