"""The portal's own system checks, beside Django's.

A deployment check (run by `manage.py check --deploy`, which the web unit runs at WARNING before it
migrates or serves: deploy/gpu-portal-web.service) for what portal/settings_safety.py cannot refuse
by itself: PORTAL_DEVELOPMENT=1 in a deployment's env file switches that refusal off, so a copied
developer's line would let every unsafe setting through in silence. `make run`, the tests, the
benchmarks and `make gpu-check` set it on purpose and never run `check --deploy`.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks

DEVELOPMENT_IN_DEPLOYMENT = "portal.W001"


@checks.register(checks.Tags.security, deploy=True)
def development_mode_check(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """PORTAL_DEVELOPMENT on where a deployment is checked: a warning, which stops the web unit."""
    if not settings.PORTAL_DEVELOPMENT:
        return []
    return [
        checks.Warning(
            "PORTAL_DEVELOPMENT is on: this is a developer's checkout, so the portal allows DEBUG, makes "
            "up a secret key per host and answers on localhost, and none of its refusals at start apply "
            '(docs/deploy.md, "Refused at start").',
            hint="Remove PORTAL_DEVELOPMENT from the deployment's env file (/etc/gpu-portal/env); only "
            "make run, the tests and make gpu-check set it.",
            id=DEVELOPMENT_IN_DEPLOYMENT,
        )
    ]
