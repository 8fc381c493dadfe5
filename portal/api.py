"""Teams and member quotas API (placeholder; being built)."""

from __future__ import annotations

from django.urls import URLPattern, URLResolver

team_urlpatterns: list[URLPattern | URLResolver] = []
