"""Option values as people type them in Slurm (`--mem 16G`, `--time 2h`, `--begin 14:00`),
turned into what the API takes. A bad value is click's usage error (exit code 2)."""

from __future__ import annotations

import re
from datetime import date, datetime, timedelta
from typing import Any

import click

_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([GM])(?:I?B)?)?\s*$", re.IGNORECASE)
_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m(?:in)?)?$")
_DAYS_AGO = re.compile(r"^(\d+)([dw])$")
_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})$")


class Memory(click.ParamType):
    """'16G', '16GiB', '16GB' → 16384 MiB; '512M' → 512: binary units, as NVML, nvidia-smi and the
    portal's forms count card memory."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = _MEMORY.match(value)
        if not match or not match[2]:
            self.fail(f"{value!r}: write a size with its unit, like 16G (GiB) or 512M (MiB).", param, ctx)
        mb = round(float(match[1]) * (1024 if match[2].upper() == "G" else 1))
        if mb <= 0:
            self.fail("the memory must be more than 0.", param, ctx)
        return mb


class Duration(click.ParamType):
    """'2h', '90m', '1h30m', '1d' or a bare number of minutes (as Slurm's --time) → minutes."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = value.strip().lower().replace(" ", "")
        match = _DURATION.match(text)
        if text.isdigit():
            minutes = int(text)
        elif text and match:
            days, hours, mins = (int(group or 0) for group in match.groups())
            minutes = (days * 24 + hours) * 60 + mins
        else:
            self.fail(f"{value!r}: write a duration like 30m, 2h, 1h30m or 1d.", param, ctx)
        if minutes < 1:
            self.fail("the duration must be at least a minute.", param, ctx)
        return minutes


class When(click.ParamType):
    """A moment: ISO 8601 ('2025-06-01 14:00', with or without a zone), 'HH:MM' (today, or tomorrow
    once that time has passed, as Slurm's --begin), 'now' or 'now+2h'. Local time unless a zone is
    given."""

    name = "time"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> datetime:
        if isinstance(value, datetime):
            return value
        text = value.strip().lower()
        now = datetime.now().astimezone()
        if text == "now":
            return now
        if text.startswith("now+"):
            try:
                return now + timedelta(minutes=Duration().convert(text[4:], param, ctx))
            except OverflowError:  # past the year 9999: a mistyped number, not a traceback
                self.fail(f"{value!r} is too far ahead.", param, ctx)
        clock = _CLOCK.match(text)
        if clock and int(clock[1]) < 24 and int(clock[2]) < 60:
            # On the local wall clock, then given the offset of that day: `now`'s is a fixed one,
            # an hour off for a time past tonight's change of the clocks.
            local = now.replace(tzinfo=None)
            at = local.replace(hour=int(clock[1]), minute=int(clock[2]), second=0, microsecond=0)
            return (at if at > local else at + timedelta(days=1)).astimezone()
        try:
            return datetime.fromisoformat(value.strip()).astimezone()
        except (ValueError, OverflowError):  # Overflow: the local offset moves it past year 1 or 9999
            self.fail(f"{value!r}: write a time like 2025-06-01 14:00, 14:00 or now+2h.", param, ctx)


class Day(click.ParamType):
    """A day for the list filters (the API's YYYY-MM-DD): a date, 'today', 'yesterday', or '7d' / '2w'
    ago."""

    name = "day"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = value.strip().lower()
        today = date.today()
        ago = _DAYS_AGO.match(text)
        if text == "today":
            return today.isoformat()
        if text == "yesterday":
            return (today - timedelta(days=1)).isoformat()
        if ago:
            try:
                return (today - timedelta(days=int(ago[1]) * (7 if ago[2] == "w" else 1))).isoformat()
            except OverflowError:  # before the year 1: a mistyped number, not a traceback
                self.fail(f"{value!r} is too long ago.", param, ctx)
        try:
            return date.fromisoformat(text).isoformat()
        except ValueError:
            self.fail(f"{value!r}: write a day like 2025-06-01, today, yesterday, 7d or 2w.", param, ctx)


class EnvPair(click.ParamType):
    """NAME=value → (NAME, value); the portal checks the name."""

    name = "NAME=value"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> tuple[str, str]:
        if isinstance(value, tuple):
            return value
        name, sep, text = value.partition("=")
        if not sep or not name:
            self.fail(f"{value!r}: write NAME=value, e.g. --env WANDB_MODE=offline.", param, ctx)
        return name, text


MEMORY = Memory()
DURATION = Duration()
WHEN = When()
DAY = Day()
ENV_PAIR = EnvPair()
