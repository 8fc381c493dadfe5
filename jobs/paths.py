"""Where scripts and working directories may be: under the host's JOB_ROOTS, nowhere else.

The web host checks the text of a path (no `..`, no control characters, absolute paths only
under a root) and, when the file is visible here too, where its symlinks lead. The worker checks
again on the GPU host, where the file really is, before anything runs.

Names end up in HTTP headers (a download's file name), log lines and file names on the GPU
host, so a control character (a line break above all) is refused at submit, and a name taken
from a row to name a download is made safe again (rows from before the check may hold anything).
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path, PurePosixPath

from django.conf import settings

from portal.errors import Invalid


def roots() -> list[Path]:
    return list(settings.JOB_ROOTS)


def roots_text() -> str:
    return ", ".join(str(r) for r in roots())


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def checked_path(text: str, *, field: str, what: str) -> Path:
    """`text` as an absolute path under a job root, or Invalid naming `field` and the fix.

    Relative paths are taken relative to the first root. Symlinks are resolved when the
    path exists on this host: a link that leads out of the roots is refused.
    """
    text = text.strip()
    if not text:
        raise Invalid(f"Give the {what}.", field=field)
    refuse_control_characters(text, field=field, what=what)
    if len(text) > 1000:
        raise Invalid(f"The {what} is not a usable path.", field=field)
    pure = PurePosixPath(text)
    if ".." in pure.parts:
        raise Invalid(
            f"The {what} may not contain '..'; give the full path under {roots_text()}.", field=field
        )
    path = Path(pure) if pure.is_absolute() else roots()[0] / pure
    root = next((r for r in roots() if _inside(path, r)), None)
    if root is None:
        raise Invalid(
            f"The {what} {text!r} is outside the job folders; use a path under {roots_text()}.", field=field
        )
    if path.exists() or path.is_symlink():
        real = Path(os.path.realpath(path))
        if not any(_inside(real, r) for r in roots()):
            raise Invalid(
                f"The {what} {text!r} is a link that leads out of the job folders ({real}); "
                f"copy the file under {roots_text()} instead.",
                field=field,
            )
    return path


# --- names ------------------------------------------------------------------------------------

# Job.name's length: an upload's name is stored there.
FILE_NAME_MAX = 200


def refuse_control_characters(text: str, *, field: str, what: str) -> None:
    """Invalid naming `field` if `text` holds a C0 control character (tab and line breaks
    included), DEL or a C1 one: nobody means to type one in a name, and a line break would split
    the headers and log lines the name goes into."""
    for position, char in enumerate(text, start=1):
        if unicodedata.category(char) == "Cc":
            raise Invalid(
                f"The {what} holds a control character ({char!r} at character {position}); "
                "give it without line breaks, tabs or other invisible characters.",
                field=field,
            )


def checked_file_name(name: str, *, field: str, what: str) -> str:
    """`name` if it is one plain file name (the worker creates it inside the job's folder), else
    Invalid naming `field` and the fix: no control characters, no '/', not '.' or '..'."""
    refuse_control_characters(name, field=field, what=what)
    if "/" in name or name.strip() in ("", ".", ".."):
        raise Invalid(
            f"The {what} {name!r} is not a plain file name; name the file like train.py.", field=field
        )
    if len(name) > FILE_NAME_MAX:
        raise Invalid(f"The {what} is longer than {FILE_NAME_MAX} characters; rename the file.", field=field)
    if len(name.encode()) > 255:  # the file system's limit is in bytes: é counts twice
        raise Invalid(f"The {what} is longer than 255 bytes; give the file a shorter name.", field=field)
    return name


def download_name(job_pk: int, script_name: str, ending: str) -> str:
    """A job's download file name: `job-<id>-<script name without .py><ending>`, with each run of
    characters other than letters, digits, '.', '-' and '_' (quotes, ';', slashes, spaces,
    control characters) as one '_'. Give it to content_disposition_header, never to an f-string."""
    stem = re.sub(r"[^\w.-]+", "_", script_name.removesuffix(".py")) or "script"
    return f"job-{job_pk}-{stem}{ending}"
