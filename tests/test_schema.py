"""/api/v1/schema/ documents every filter of every list endpoint (its FilterSet's filters)."""

from __future__ import annotations

import re

import pytest
from django.urls import resolve
from rest_framework.mixins import ListModelMixin
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db

# The lists the portal filters today; a list added later is found and checked the same way.
FILTERED_LISTS = {
    "/api/v1/gpus/",
    "/api/v1/images/",
    "/api/v1/jobs/",
    "/api/v1/reservations/",
    "/api/v1/teams/{slug}/audit/",
}


def _schema(user) -> dict:
    client = APIClient()
    client.force_authenticate(user)
    response = client.get("/api/v1/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    return response.json()


def _filterset_of_list(path: str):  # type: ignore[no-untyped-def]
    """The FilterSet of the view that answers GET `path` with a list, else None."""
    view = resolve(re.sub(r"\{[^}]+\}", "1", path)).func
    actions = getattr(view, "actions", None)
    is_list = actions.get("get") == "list" if actions else issubclass(view.cls, ListModelMixin)
    return getattr(view.cls, "filterset_class", None) if is_list else None


def test_the_schema_documents_every_filter_of_every_list(alice):
    schema = _schema(alice)
    checked = set()
    for path, operations in schema["paths"].items():
        if "get" not in operations or (filterset := _filterset_of_list(path)) is None:
            continue
        documented = {p["name"]: p for p in operations["get"].get("parameters", []) if p["in"] == "query"}
        missing = set(filterset.base_filters) - set(documented)
        assert not missing, f"{path}: {sorted(missing)} not in the schema"
        for name in filterset.base_filters:
            assert documented[name]["schema"].get("type"), (path, name)
        checked.add(path)
    assert checked >= FILTERED_LISTS


def test_the_schema_gives_each_filter_its_type_and_choices(alice):
    paths = _schema(alice)["paths"]

    def param(path: str, name: str) -> dict:
        (found,) = [p for p in paths[path]["get"]["parameters"] if p["name"] == name]
        return found

    status = param("/api/v1/reservations/", "status")["schema"]
    assert status["enum"] == ["active", "cancelled", "ended", "open", "released", "upcoming"]
    assert "queued" in param("/api/v1/jobs/", "status")["schema"]["enum"]
    assert param("/api/v1/jobs/", "since")["schema"] == {"type": "string", "format": "date"}
    assert param("/api/v1/jobs/", "mine")["schema"]["type"] == "boolean"
    assert "reservation.cancel" in param("/api/v1/teams/{slug}/audit/", "action")["schema"]["enum"]
    assert param("/api/v1/gpus/", "server")["description"] == "A server's name."
    assert param("/api/v1/images/", "server")["description"] == "A server's name: the images it has."
