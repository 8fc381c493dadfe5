# `python -m portal.gpu_check` must start on a GPU machine's Python that has none of the portal's
# requirements yet, to install them into a temporary venv (portal/gpu_check/bootstrap.py): only
# there is Celery missing. Anything that uses Celery imports it itself, and fails naming it.
try:
    from portal.celery import app as celery_app
except ModuleNotFoundError as exc:
    if exc.name != "celery":
        raise
    celery_app = None

__all__ = ("celery_app",)
