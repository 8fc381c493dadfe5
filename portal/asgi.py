"""The portal under an ASGI server (gunicorn with uvicorn's worker: `make run`, deploy/).

The same settings module as portal/wsgi.py; PORTAL_ASGI tells it that this process serves
requests from threads of their own, so it connects to the database per request (settings.py).
Views stay sync and run in threads; only the live streams (jobs/logs/stream.py) are async.
In front of Django sits the JupyterLab proxy (jobs.sessions.lab_proxy), which routes by host name: on
LAB_ORIGIN's it serves the labs (HTTP and websockets, checked and forwarded) and nothing else, never
reaching Django; on the portal's, /sessions/<id>/lab/… sends the lab's owner there, and everything
else is Django's.
"""

import os

from django.core.asgi import get_asgi_application

os.environ["PORTAL_ASGI"] = "true"  # read when the settings load, in get_asgi_application
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
django_application = get_asgi_application()

from jobs.sessions.lab_proxy import lab_proxy  # noqa: E402 - imports models: only once Django is set up

application = lab_proxy(django_application)
