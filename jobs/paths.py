"""Where scripts and working directories may be: under the host's JOB_ROOTS, nowhere else.

The web host checks the text of a path (no `..`, absolute paths only under a root) and,
when the file is visible here too, where its symlinks lead. The worker checks again on
the GPU host, where the file really is, before anything runs.
"""

from __future__ import annotations

import os
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
    if "\x00" in text or len(text) > 1000:
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
