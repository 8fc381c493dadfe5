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
    if is_local_path(next_url, request):
        return HttpResponseRedirect(next_url)
    return redirect(fallback, *args)


def is_local_path(url: str, request: HttpRequest) -> bool:
    """`url` is an absolute path on this site ("/reservations/12/"). Anything else, "abc" included,
    is not: redirect() would read a bare word as a URL name to reverse, a NoReverseMatch (a 500)."""
    return url.startswith("/") and url_has_allowed_host_and_scheme(
        url, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    )
