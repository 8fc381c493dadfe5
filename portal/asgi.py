"""The portal under an ASGI server (gunicorn with uvicorn's worker: `make run`, deploy/).

The same settings module as portal/wsgi.py; PORTAL_ASGI tells it that this process serves
requests from threads of their own, so it connects to the database per request (settings.py).
Views stay sync and run in threads; only the live streams (jobs/log_stream.py) are async.
"""

import os

from django.core.asgi import get_asgi_application

os.environ["PORTAL_ASGI"] = "true"  # read when the settings load, in get_asgi_application
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
application = get_asgi_application()
