"""Small view helpers every app's pages share."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponseRedirect
from django.shortcuts import redirect
from django.utils.http import url_has_allowed_host_and_scheme


def redirect_back(request: HttpRequest, fallback: str, *args: object) -> HttpResponseRedirect:
    """To the page the button was on (the form's `next`), else to the URL named `fallback`.

    Only a path on this site is followed: a `next` pointing elsewhere (an open redirect) is ignored.
    """
    next_url = request.POST.get("next", "")
    if next_url and url_has_allowed_host_and_scheme(
        next_url, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return redirect(next_url)
    return redirect(fallback, *args)
