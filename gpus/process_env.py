"""The environment variables a GPU process carries for gpus to read: the string contract between
whoever starts work on a host (jobs.environment writes them) and gpus, which finds that work among
a host's processes (gpus.simulated reads them). Declared here, in the lower app, so the writer and
the reader name one constant, and the reader never imports the writer.
"""

from __future__ import annotations

SERVER_VAR = "PORTAL_SERVER"  # the GPU host's name (WORKER_SERVER) the work was started for
INSTANCE_VAR = "PORTAL_INSTANCE"  # which portal started it (PORTAL_INSTANCE_ID): another's is not ours
