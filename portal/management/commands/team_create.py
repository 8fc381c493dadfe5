"""`manage.py team_create vision-lab --leader alice --members bob,carol`: the first team of a new
install (docs/deploy.md), through the same service as the Teams page (portal.teams.team_create).

Nothing is written on any error, and every error is named at once (each unknown user). Run again
with the same leaders and members it changes nothing and says so; a team that exists with others
is refused, pointing at its members page.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from portal.errors import ServiceError
from portal.models import Membership, Team
from portal.teams import name_from_slug, team_create


def _names(values: list[str] | None) -> list[str]:
    """`--members bob,carol --members dave` → [bob, carol, dave]."""
    return [name.strip() for value in values or () for name in value.split(",") if name.strip()]


class Command(BaseCommand):
    help = (
        "Create a team with its leaders and members (existing portal users), e.g. "
        "team_create vision-lab --leader alice --members bob,carol."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug", help="the team's short name in URLs, e.g. vision-lab")
        parser.add_argument(
            "--name", default="", help='its display name; default: from the slug ("Vision Lab")'
        )
        parser.add_argument(
            "--leader", "--leaders", action="append", dest="leaders", metavar="USER[,USER]",
            help="who leads it: sets its members' quotas, sees their jobs (repeatable, or comma-separated)",
        )  # fmt: skip
        parser.add_argument(
            "--members", "--member", action="append", dest="members", metavar="USER[,USER]",
            help="its members (repeatable, or comma-separated)",
        )  # fmt: skip

    def handle(self, *args: str, **options: Any) -> None:
        slug = options["slug"].strip().lower()
        leaders, members = _names(options["leaders"]), _names(options["members"])
        existing = Team.objects.filter(slug=slug).first()
        if existing is not None:
            self._exists(existing, leaders, members)
            return
        try:
            team = team_create(
                actor=None,
                name=options["name"] or name_from_slug(slug),
                slug=slug,
                leaders=leaders,
                members=members,
            )
        except ServiceError as error:
            lines = [
                f"  {field or 'team'}: {m}"
                for field, ms in (error.errors or {"": [error.message]}).items()
                for m in ms
            ]
            raise CommandError("Nothing was written:\n" + "\n".join(lines)) from None
        self.stdout.write(
            f"Created team {team.name} ({team.slug}): {len(leaders)} leader(s), {len(members)} member(s). "
            f"Set its quota and shares on /teams/{team.slug}/; "
            f"change its members on /teams/{team.slug}/members/."
        )

    def _exists(self, team: Team, leaders: list[str], members: list[str]) -> None:
        """The same team again is no error (a re-run of the install's steps); another one is."""
        held = dict(team.memberships.values_list("user__username", "role"))
        asked = {
            **{name: Membership.Role.MEMBER for name in members},
            **{name: Membership.Role.LEADER for name in leaders},
        }
        if held == asked:
            self.stdout.write(
                f"Team {team.name} ({team.slug}) exists already with these leaders and members: "
                "nothing changed."
            )
            return
        now = ", ".join(f"{name} ({role})" for name, role in sorted(held.items())) or "nobody"
        raise CommandError(
            f"Team {team.slug} exists already, with {now}. Nothing was written. Change its members on "
            f"/teams/{team.slug}/members/, or pick another slug."
        )
