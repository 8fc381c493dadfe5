from django.contrib import admin, messages
from django.db.models import Prefetch, QuerySet
from django.http import HttpRequest
from django.utils.html import format_html_join

from gpus.models import ContainerImage, ImagePull
from jobs.images import images_pull_send
from jobs.models import Job


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    """Read-mostly: status changes go through the services (cancel on the job page)."""

    list_display = ["id", "name", "owner", "team", "server", "status", "image", "created_at", "exit_code"]
    list_filter = ["status", "server", "team"]
    list_select_related = ["owner", "team", "server", "image"]
    search_fields = ["name", "owner__username", "script_path"]
    readonly_fields = [f.name for f in Job._meta.fields if f.name != "script_source"]
    exclude = ["script_source"]

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False


# A gpus model, registered here (it shows under GPUs all the same): its action sends jobs' pull task.
@admin.register(ContainerImage)
class ContainerImageAdmin(admin.ModelAdmin):
    """The images people may run jobs and labs in (docs/containers.md). "Pull on every host now"
    sends each selected image's pull to every server that has it; each host records how it went
    (Last pulls)."""

    list_display = ["name", "reference", "server_names", "network", "has_jupyterlab", "last_pulls"]
    list_filter = ["servers", "network", "has_jupyterlab"]
    search_fields = ["name", "reference", "description"]
    filter_horizontal = ["servers"]
    actions = ["pull_now"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[ContainerImage]:
        pulls = Prefetch(
            "pulls", queryset=ImagePull.objects.select_related("server").order_by("server__name")
        )
        return super().get_queryset(request).prefetch_related("servers", pulls)

    @admin.display(description="Servers")
    def server_names(self, image: ContainerImage) -> str:
        return ", ".join(server.name for server in image.servers.all()) or "—"

    @admin.display(description="Last pulls")
    def last_pulls(self, image: ContainerImage) -> str:
        pulls = image.pulls.all()
        if not pulls:
            return "—"
        rows = (
            (p.server.name, "ok" if p.ok else "failed", p.at.strftime("%Y-%m-%d %H:%M"), p.detail)
            for p in pulls
        )
        return format_html_join("", '<div title="{3}">{0}: {1}, {2}</div>', rows)

    @admin.action(description="Pull on every host now", permissions=["change"])
    def pull_now(self, request: HttpRequest, queryset: QuerySet[ContainerImage]) -> None:
        sent = images_pull_send(images=list(queryset.values_list("name", flat=True)))
        if not sent:
            self.message_user(
                request, "No server has these images: add servers to them first.", messages.WARNING
            )
        for one in sent:
            level = messages.ERROR if one.error else messages.SUCCESS
            self.message_user(request, f"Sent: {one}" if not one.error else str(one), level)
