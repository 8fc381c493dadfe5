"""`python -m portal.gpu_check`: install what this Python lacks (from var/gpu-check-wheels/), then check."""

import sys

from portal.gpu_check.bootstrap import ensure_requirements

ensure_requirements(sys.argv[1:])

from portal.gpu_check.runner import main  # noqa: E402  (needs what ensure_requirements installed)

sys.exit(main(sys.argv[1:]))
