from django import forms
from django.contrib import admin

from gpus.models import (
    GPU,
    Allocation,
    CalendarFeed,
    GPUProcess,
    Reservation,
    Server,
    SlurmCluster,
    SlurmNode,
    Violation,
    WatchdogPolicy,
)
from gpus.servers import HOST_JOIN


class GPUInline(admin.TabularInline):
    model = GPU
    fields = [
        "node",
        "index",
        "slurm_job",
        "uuid",
        "name",
        "memory_total_mb",
        "memory_used_mb",
        "utilization_pct",
        "updated_at",
    ]
    readonly_fields = fields
    extra = 0
    can_delete = False


class SlurmClusterInline(admin.StackedInline):
    """A server of kind "Slurm cluster" is reached through these (docs/slurm.md)."""

    model = SlurmCluster
    extra = 0
    max_num = 1


class SlurmNodeInline(admin.TabularInline):
    model = SlurmNode
    fields = [
        "name",
        "state",
        "slurm_state",
        "reason",
        "partitions",
        "cpus",
        "gpus",
        "gpus_used",
        "updated_at",
    ]
    readonly_fields = fields
    extra = 0
    can_delete = False


class SlurmClusterAddForm(forms.ModelForm):
    """The one server added by hand: a Slurm cluster, whose worker needs its settings before it can
    report (docs/slurm.md). A GPU host is never added here: its first report registers it."""

    kind = forms.ChoiceField(
        choices=[(Server.Kind.SLURM, Server.Kind.SLURM.label)],
        initial=Server.Kind.SLURM,
        help_text="Only a Slurm cluster is added by hand. A GPU host registers itself with its first report.",
    )

    class Meta:
        model = Server
        fields = ["name", "kind"]


@admin.register(Server)
class ServerAdmin(admin.ModelAdmin):
    """Servers as their workers report them. A GPU host joins by itself (gpus.servers.HOST_JOIN, shown
    above the list), so "Add" makes only a Slurm cluster. What a report brings (driver, CPUs, cards)
    is read-only here, and so is draining: admins drain on the server's page in the portal, which
    says what it means and writes the audit log (gpus/servers.py)."""

    list_display = [
        "name",
        "kind",
        "hostname",
        "status",
        "draining",
        "simulated",
        "containers_ok",
        "jobs_as_root",
        "driver_version",
        "last_seen",
    ]
    list_filter = ["kind", "draining", "simulated", "containers_ok", "jobs_as_root"]
    search_fields = ["name", "hostname"]
    # What the host's worker reports (containers_*, jobs_as_root: what it found when it started): its
    # word only.
    readonly_fields = [
        "hostname",
        "simulated",
        "driver_version",
        "cuda_version",
        "cpu_count",
        "ram_mb",
        "last_seen",
        "last_history_at",
        "job_slots",
        "job_slots_at",
        "containers_ok",
        "containers_detail",
        "draining",
        "drain_reason",
        "jobs_as_root",
    ]
    exclude = ["telemetry_round_seconds", "watchdog_round_seconds"]
    inlines = [SlurmClusterInline, SlurmNodeInline, GPUInline]
    change_list_template = "admin/gpus/server/change_list.html"

    def get_form(self, request, obj=None, change=False, **kwargs):  # type: ignore[no-untyped-def]
        if obj is None:
            kwargs["form"] = SlurmClusterAddForm
        return super().get_form(request, obj, change=change, **kwargs)

    def get_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        return ["name", "kind"] if obj is None else super().get_fields(request, obj)

    def get_readonly_fields(self, request, obj=None):  # type: ignore[no-untyped-def]
        return [] if obj is None else self.readonly_fields

    def get_inlines(self, request, obj):  # type: ignore[no-untyped-def]
        return [SlurmClusterInline] if obj is None else self.inlines

    def changelist_view(self, request, extra_context=None):  # type: ignore[no-untyped-def]
        extra = {"host_join": HOST_JOIN, **(extra_context or {})}
        return super().changelist_view(request, extra_context=extra)


# The container images' admin (gpus.models.ContainerImage) is registered by jobs/admin.py: its
# "Pull on every host now" sends a jobs task, and gpus never imports jobs.


@admin.register(GPU)
class GPUAdmin(admin.ModelAdmin):
    list_display = ["uuid", "server", "index", "name", "memory_total_mb", "memory_used_mb", "utilization_pct"]
    list_filter = ["server", "name"]
    search_fields = ["uuid", "name", "server__name"]


@admin.register(GPUProcess)
class GPUProcessAdmin(admin.ModelAdmin):
    """The telemetry round writes these rows, and rewrites a card's only when its reported list
    changes (GPU.processes_digest): a row added or changed here would stay wrong, so neither is
    offered; a deletion (a card's or a server's takes them along) makes the round rewrite the
    card's list."""

    list_display = ["pid", "gpu", "username", "used_memory_mb", "command"]
    search_fields = ["username", "command"]

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False

    def delete_model(self, request, obj) -> None:  # type: ignore[no-untyped-def]
        super().delete_model(request, obj)
        GPU.objects.filter(uuid=obj.gpu_id).update(processes_digest="")

    def delete_queryset(self, request, queryset) -> None:  # type: ignore[no-untyped-def]
        cards = set(queryset.values_list("gpu_id", flat=True))
        super().delete_queryset(request, queryset)
        GPU.objects.filter(uuid__in=cards).update(processes_digest="")


class AllocationInline(admin.TabularInline):
    model = Allocation
    fields = ["gpu", "memory_mb", "start", "end", "live"]
    readonly_fields = fields
    extra = 0
    can_delete = False


@admin.register(Reservation)
class ReservationAdmin(admin.ModelAdmin):
    """Read-only: bookings change through the portal's services, which check the rules and audit."""

    list_display = ["id", "owner", "team", "start", "end", "status", "note"]
    list_filter = ["team"]
    search_fields = ["owner__username", "note"]
    date_hierarchy = "start"
    inlines = [AllocationInline]

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False


@admin.register(Violation)
class ViolationAdmin(admin.ModelAdmin):
    """Written by the GPU watchdog; shown here, changed only by it."""

    list_display = [
        "id",
        "kind",
        "gpu",
        "pid",
        "os_user",
        "user",
        "job_id",
        "memory_mb",
        "first_seen",
        "action",
    ]
    list_filter = ["kind", "action", "server"]
    search_fields = ["gpu__uuid", "os_user", "user__username", "command"]
    readonly_fields = [f.name for f in Violation._meta.fields]

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_delete_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        # An open violation is the watchdog's working record (a stop may be under way): it can be
        # deleted once it has ended, never before.
        if obj is not None and obj.ended_at is None:
            return False
        return super().has_delete_permission(request, obj)

    def delete_queryset(self, request, queryset) -> None:  # type: ignore[no-untyped-def]
        # The bulk action asks has_delete_permission per object first; this keeps it so if it ever stops.
        super().delete_queryset(request, queryset.exclude(ended_at=None))


@admin.register(WatchdogPolicy)
class WatchdogPolicyAdmin(admin.ModelAdmin):
    """What the watchdog does about each kind; a kind without a row keeps its default (settings)."""

    list_display = ["kind", "action", "grace_seconds"]


@admin.register(CalendarFeed)
class CalendarFeedAdmin(admin.ModelAdmin):
    """Who has which calendar feed; deleting one ends its address (its owner can make a new one).
    The secret is the address itself, so it is not shown here."""

    list_display = ["owner", "scope", "team", "server", "created_at", "last_fetched_at"]
    list_filter = ["scope"]
    search_fields = ["owner__username", "team__slug", "server__name"]
    exclude = ["secret"]
    readonly_fields = [f.name for f in CalendarFeed._meta.fields if f.name != "secret"]

    def lookup_allowed(self, lookup: str, value: str, request=None) -> bool:  # type: ignore[no-untyped-def,override]
        # ?secret__startswith=a…: a filter that shows or hides rows would spell the secret out.
        if lookup.split("__")[0] == "secret":
            return False
        return super().lookup_allowed(lookup, value, request)

    def has_add_permission(self, request) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False
