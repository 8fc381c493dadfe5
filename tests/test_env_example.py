"""deploy/env.example is generated from the settings' own readers (portal/env_example.py; issue 42
item 7): the file is what the generator writes, and its commented-out lines are the settings'
real defaults, checked by loading the settings with and without them."""

from __future__ import annotations

import difflib
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from portal.env import READS, EnvRead, env_choice, env_int, env_list
from portal.env_example import (
    ENV_EXAMPLE,
    MARKER,
    REGENERATE,
    WORKER_UNIT,
    EnvExampleError,
    generate,
    header_of,
    header_values,
    settings_reads,
    units_read,
)
from portal.settings import BASE_DIR


@pytest.fixture(scope="module")
def header() -> str:
    return header_of(ENV_EXAMPLE.read_text())


@pytest.fixture(scope="module")
def reads(header) -> dict[str, EnvRead]:
    return settings_reads(header_values(header))


def test_env_example_is_what_the_settings_generate(header, reads):
    current = ENV_EXAMPLE.read_text()

    wanted = generate(header, reads, units_read())

    diff = "\n".join(
        difflib.unified_diff(current.splitlines(), wanted.splitlines(), "env.example", "generated")
    )
    assert current == wanted, f"deploy/env.example is not what the settings generate: {REGENERATE}\n{diff}"


def test_it_shows_what_the_first_install_had_to_guess():
    lines = ENV_EXAMPLE.read_text().splitlines()

    for line in [
        "#GPU_BACKEND=auto",  # was shown as nvml, which only the worker unit sets
        "# gpu-portal-worker.service sets nvml.",
        "#WATCHDOG_DRY_RUN=false",  # was shown as true
        "#SESSION_BIND_ADDRESS=127.0.0.1",
        "#EMAIL_DELIVERY=file",
        "#JOB_DRAIN_SECONDS=2",
        "#PORTAL_INSTANCE_ID=",
        "#SESSION_COOKIE_SECURE=true",  # HTTPS=true's, in the header
        "#SECURE_HSTS_SECONDS=31536000",
        "REDIS_URL=redis://:CHANGE-ME@portal-host:6379/0",
    ]:
        assert line in lines, line


def test_its_commented_lines_are_the_defaults(tmp_path):
    """The file's promise, checked without the generator: a host that loads every commented-out
    line too gets the very settings of one that loads the header alone."""
    text = ENV_EXAMPLE.read_text()
    head, generated = text.split(MARKER, 1)
    worker = units_read()[WORKER_UNIT]
    var_dir = str(tmp_path / "var")
    local = {
        header_values(head)["PORTAL_VAR_DIR"]: var_dir,
        worker.python: sys.executable,
        worker.folder: str(BASE_DIR),
    }
    uncommented = {}
    for line in generated.splitlines():
        name, sep, value = line.removeprefix("#").partition("=")
        if line.startswith("#") and sep and name.isidentifier() and "<this host" not in value:
            value = value[1:-1] if value.startswith('"') and value.endswith('"') else value  # as systemd
            for deployed, here in local.items():
                value = value.replace(deployed, here)
            uncommented[name] = value
    assert len(uncommented) > 100 and "SESSION_BIND_ADDRESS" in uncommented

    alone = _settings(tmp_path, header_values(head))
    with_all = _settings(tmp_path, {**header_values(head), **uncommented})

    assert {name: with_all[name] for name in alone if with_all[name] != alone[name]} == {}


def _settings(tmp_path: Path, values: dict[str, str]) -> dict[str, str]:
    key = tmp_path / "secret_key"
    if not key.exists():
        key.write_text(secrets.token_urlsafe(50))
    env = {
        "PATH": os.environ["PATH"],
        **values,
        "PORTAL_VAR_DIR": str(tmp_path / "var"),
        "SECRET_KEY_FILE": str(key),
    }
    dump = "import json, portal.settings as s; print(json.dumps({k: repr(getattr(s, k)) for k in dir(s) if k.isupper()}))"  # noqa: E501
    result = subprocess.run(
        [sys.executable, "-c", dump], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# --- the generator keeps the catalogue honest --------------------------------------------------------


def test_a_setting_without_help_stops_the_generator_naming_it(header, reads):
    new = {**reads, "NEW_KNOB_SECONDS": EnvRead("NEW_KNOB_SECONDS", "5", "1-60")}

    with pytest.raises(EnvExampleError) as raised:
        generate(header, new, units_read())

    said = str(raised.value)
    assert "NEW_KNOB_SECONDS is read by the settings but portal/env_catalogue.py has no help for it" in said
    assert "run `make env-example`" in said


def test_help_for_a_setting_nothing_reads_stops_the_generator(header, reads):
    gone = {name: read for name, read in reads.items() if name != "JOB_DRAIN_SECONDS"}

    with pytest.raises(
        EnvExampleError, match=r"JOB_DRAIN_SECONDS is in portal/env_catalogue\.py but no setting reads it"
    ):
        generate(header, gone, units_read())


def test_a_header_line_no_setting_reads_stops_the_generator(header, reads):
    typo = header.replace(MARKER, "PORTAL_UR=https://portal.example.org\n\n" + MARKER)

    with pytest.raises(EnvExampleError, match="header names PORTAL_UR, which no setting reads"):
        generate(typo, reads, units_read())


def test_the_readers_record_each_variable_with_its_default_and_range(monkeypatch):
    monkeypatch.setenv("READS_TEST_LIST", "a,b")
    env_int("READS_TEST_SECONDS", 5, min_value=1, max_value=60)
    env_choice("READS_TEST_MODE", "auto", ("auto", "nvml"))
    env_list("READS_TEST_LIST", ["x", "y"])

    assert READS["READS_TEST_SECONDS"] == EnvRead("READS_TEST_SECONDS", "5", "1-60")
    assert READS["READS_TEST_MODE"] == EnvRead("READS_TEST_MODE", "auto", "one of: auto, nvml")
    # The default, not the value set.
    assert READS["READS_TEST_LIST"] == EnvRead("READS_TEST_LIST", "x,y", "comma-separated")
