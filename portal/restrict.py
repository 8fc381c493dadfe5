"""What a model's `restrict(user, action)` answers, and who is an admin: the words every model's
queryset uses, below the models (portal.models' Team uses them too), so no model imports upward.
portal.access re-exports them for everything else."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser

# What a model's `restrict(user, action)` answers (NetBox's RestrictedQuerySet): "view" to see it,
# "change" to act on it (cancel, end, stop). Where the two differ is the model's own rule.
VIEW = "view"
CHANGE = "change"
ACTIONS = (VIEW, CHANGE)


def check_action(action: str) -> None:
    """A `restrict` asked for an action no model answers is a bug: fail loudly, never show all."""
    if action not in ACTIONS:
        raise ValueError(f"Unknown action {action!r}; restrict answers one of {', '.join(ACTIONS)}.")


def is_admin(user: AbstractBaseUser | None) -> bool:
    """Portal admins are staff users: they set team quotas and see every team."""
    return bool(user is not None and user.is_authenticated and user.is_staff)
