"""A deployment serves collectstatic's hashed, compressed copies of the static files, cacheable for
years (issue 42 item 8); a developer's machine serves the sources as they are edited.

Shown on the web unit's own lines (deploy/gpu-portal-web.service): its collectstatic, then its
gunicorn, with a deployment's environment (no PORTAL_DEVELOPMENT), asked as a browser asks.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from portal.settings import BASE_DIR
from tests.conftest import free_port
from tests.test_settings_safety import WEB_UNIT, command, production_env, run, unit

HOST = {"Host": "portal.example.org"}  # ALLOWED_HOSTS of production_env; 127.0.0.1 is the labs' origin
HASHED = re.compile(r"/static/(?P<name>[\w/.-]+)\.(?P<hash>[0-9a-f]{12})\.(?P<ext>css|js)\b")
TEN_YEARS = "max-age=315360000, public, immutable"  # whitenoise's for a file named by its content


@dataclass(frozen=True)
class Deployed:
    url: str
    static_root: Path


@pytest.fixture(scope="module")
def deployed(tmp_path_factory) -> Iterator[Deployed]:
    """The web unit's collectstatic and gunicorn, as systemd runs them (without its migrate: no
    request below reads the database)."""
    tmp = tmp_path_factory.mktemp("deployed")
    environment, before, start = unit(WEB_UNIT)
    env = production_env(tmp, **{**environment, "PORT": str(free_port())})
    collect = next(line for line in before if "collectstatic" in line)
    collected = run(command(collect, env), env, timeout=120)
    assert collected.returncode == 0, collected.stderr
    log = (tmp / "gunicorn.log").open("w")
    web = subprocess.Popen(command(start, env), cwd=BASE_DIR, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{env['PORT']}"
    try:
        _wait_until_serving(web, url, tmp / "gunicorn.log")
        yield Deployed(url, tmp / "var" / "staticfiles")
    finally:
        web.terminate()
        web.wait(30)
        log.close()


def _wait_until_serving(web: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert web.poll() is None, f"gunicorn exited:\n{log.read_text()}"
        try:
            httpx.get(f"{url}/static/css/portal.css", headers=HOST, timeout=2)
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"gunicorn did not answer in 60 s:\n{log.read_text()}"
            time.sleep(0.2)


def test_pages_name_the_hashed_copies(deployed):
    page = httpx.get(f"{deployed.url}/login/", headers=HOST)

    assert page.status_code == 200, page.text[:2000]
    named = {match["name"] + "." + match["ext"] for match in HASHED.finditer(page.text)}
    assert {"css/portal.css", "js/portal.js", "vendor/htmx-2.0.11.min.js", "js/live.js"} <= named
    assert '"/static/css/portal.css"' not in page.text


@pytest.mark.parametrize("source", ["css/portal.css", "vendor/htmx-2.0.11.min.js", "js/live.js"])
def test_a_hashed_file_comes_compressed_and_cacheable_for_years(deployed, source):
    hashed = json.loads((deployed.static_root / "staticfiles.json").read_text())["paths"][source]

    answer = httpx.get(f"{deployed.url}/static/{hashed}", headers={**HOST, "Accept-Encoding": "gzip"})

    assert answer.status_code == 200
    assert answer.headers["content-encoding"] == "gzip"
    assert answer.headers["cache-control"] == TEN_YEARS
    assert "Accept-Encoding" in answer.headers["vary"]
    assert answer.content == (deployed.static_root / hashed).read_bytes()  # httpx has unzipped it


def test_an_unhashed_name_is_cached_only_briefly(deployed):
    """What pages never name: a minute, so a change reaches browsers that asked by this name."""
    answer = httpx.get(f"{deployed.url}/static/css/portal.css", headers={**HOST, "Accept-Encoding": "gzip"})

    assert answer.status_code == 200
    assert answer.headers["cache-control"] == "max-age=60, public"


def test_every_static_file_a_template_names_is_collected(deployed):
    """A name missing from collectstatic's manifest is a 500 on a deployment's page (and nowhere
    else: a developer's machine serves the sources)."""
    manifest = json.loads((deployed.static_root / "staticfiles.json").read_text())["paths"]
    named = set()
    for template in (BASE_DIR / "templates").rglob("*.html"):
        text = template.read_text()
        named |= set(re.findall(r"""\{%\s*static\s+['"]([^'"]+)['"]""", text))
        named |= set(re.findall(r"""static\(\s*['"]([^'"]+)['"]\s*\)""", text))

    assert named and sorted(named - set(manifest)) == []
