"""LAB_ORIGIN, the labs' own origin (docs/configuration.md, docs/sessions.md "Two origins"): read as
an origin or not at all, and refused at start-up wherever it would share the portal's cookies or
be trusted by its CSRF check; and what `make run` says about it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from portal.env import ImproperlyConfiguredEnv, env_origin, lab_origin_problem
from portal.management.commands.runportal import _lab_note
from portal.settings import BASE_DIR


def test_it_reads_an_origin_as_browsers_write_it(monkeypatch):
    for given, read in [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("HTTPS://Labs.Portal.Example:443/", "https://labs.portal.example"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("https://labs.example:8443", "https://labs.example:8443"),
    ]:
        monkeypatch.setenv("LAB_X", given)
        assert env_origin("LAB_X", "") == read


@pytest.mark.parametrize(
    "nonsense",
    [
        *("labs.example", "ftp://labs.example", "https://labs.example/lab", "https://u:p@labs.example"),
        *("https://labs.example?x=1", "https://labs example", "https://labs.example:0", "https://:99999"),
    ],
)
def test_it_refuses_what_is_not_an_origin(monkeypatch, nonsense):
    monkeypatch.setenv("LAB_X", nonsense)

    with pytest.raises(ImproperlyConfiguredEnv, match=r"LAB_X=.*e\.g\. LAB_X=https://labs\.portal\.example"):
        env_origin("LAB_X", "")


def problem(lab: str, **given) -> str:  # type: ignore[no-untyped-def]
    values = {"portal_url": "https://portal.example", "trusted": [], "cookie_domains": {}, "https": True}
    return lab_origin_problem(lab, **{**values, **given})


def test_a_lab_origin_of_its_own_passes():
    assert problem("https://labs.portal.example", trusted=["https://portal.example"]) == ""
    assert problem("https://portal-labs.example") == ""
    assert problem("http://127.0.0.1:8000", portal_url="http://localhost:8000", https=False) == ""


def test_it_refuses_the_portals_own_host_name_on_any_port():
    assert "has the portal's own host name" in problem("https://portal.example:8443")
    assert "cookies do not tell ports apart" in problem(
        "http://localhost:9000", portal_url="http://localhost:8000"
    )


def test_it_refuses_a_host_the_portals_cookies_reach():
    for domain in (".portal.example", "portal.example"):
        found = problem("https://labs.portal.example", cookie_domains={"SESSION_COOKIE_DOMAIN": domain})
        assert found.startswith(f"SESSION_COOKIE_DOMAIN={domain!r} sends the portal's cookie to")
    found = problem("https://labs.portal.example", cookie_domains={"CSRF_COOKIE_DOMAIN": ".portal.example"})
    assert "leave CSRF_COOKIE_DOMAIN unset" in found
    assert (
        problem("https://labs.other.example", cookie_domains={"SESSION_COOKIE_DOMAIN": ".portal.example"})
        == ""
    )


def test_it_refuses_an_origin_the_portals_csrf_check_trusts():
    assert "Take it out of CSRF_TRUSTED_ORIGINS" in problem(
        "https://labs.x.example", trusted=["https://labs.x.example"]
    )
    assert "covers LAB_ORIGIN" in problem("https://labs.x.example", trusted=["https://*.x.example"])
    assert problem("https://labs.x.example", trusted=["http://*.x.example", "https://*.y.example"]) == ""


def test_with_https_the_labs_are_https_too():
    assert problem("http://labs.portal.example").startswith("HTTPS=true but LAB_ORIGIN=")


def test_the_portal_refuses_to_start_with_a_lab_origin_that_shares_its_cookies(tmp_path):
    env = {
        "PATH": os.environ["PATH"],
        "PORTAL_VAR_DIR": str(tmp_path),
        "PORTAL_URL": "http://localhost:8000",
        "LAB_ORIGIN": "http://localhost:8001",
    }
    result = subprocess.run(
        [sys.executable, "-c", "import portal.settings"],
        cwd=BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode != 0
    assert "LAB_ORIGIN='http://localhost:8001' has the portal's own host name" in result.stderr


@pytest.mark.parametrize(
    ("bind", "lab", "says"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000", ""),
        ("0.0.0.0", "http://127.0.0.1:8000", "Labs open only in a browser on this machine"),
        ("127.0.0.1", "http://127.0.0.1:9000", "is not this web server"),
        ("10.0.0.5", "http://127.0.0.1:8000", "is not this web server"),
        ("0.0.0.0", "https://labs.portal.example", ""),
    ],
)
def test_make_run_says_when_the_labs_would_not_open(settings, bind, lab, says):
    settings.LAB_ORIGIN = lab

    note = _lab_note(bind, 8000)

    assert (says in note) if says else note == ""
