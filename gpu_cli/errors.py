"""Exit codes that scripts can rely on (docs/cli.md), one exception class each.

click prints a ClickException's message to stderr as "Error: …" and exits with its exit_code;
usage errors are click's own (2).
"""

from __future__ import annotations

import click

REFUSED = 1
UNREACHABLE = 3
NOT_FOUND = 4
INTERRUPTED = 130  # Ctrl-C while following a log, as a shell reports SIGINT


class Refused(click.ClickException):
    """The portal said no (4xx): its `detail`, then the field errors the detail does not already say."""

    exit_code = REFUSED

    def __init__(self, message: str, errors: dict[str, list[str]] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or {}

    def format_message(self) -> str:
        lines = [self.message]
        for field, messages in self.errors.items():
            for text in messages:
                line = text if field == "non_field_errors" else f"{field}: {text}"
                if self.message not in (text, line):
                    lines.append(f"  {line}")
        return "\n".join(lines)


class Unreachable(click.ClickException):
    """No usable answer: the portal is down or unreachable, failed (5xx), or we are not logged in."""

    exit_code = UNREACHABLE


class Failed(Unreachable):
    """The portal answered, with a 5xx of its own (not an outage's 503): this request failed, the
    next may not (`gpu cancel` of several jobs goes on)."""


class NotFound(click.ClickException):
    """404: no such job or booking, or not yours to see."""

    exit_code = NOT_FOUND
