"""What a lower app asks and a higher app answers (issue 20): the GPU hosts `make run` starts
workers for, template slots, the scheduler's wake-up channel, the mail tasks' home, and the one
task still sent by name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.management.base import CommandError
from django.template import Context, Template
from django.urls import reverse

from portal import hooks, mail, tasks
from portal.celery import app
from portal.management.commands.runportal import _worker_servers
from portal.wakeups import QUEUE_SCHEDULER


def test_gpus_answers_which_hosts_this_machine_stands_for(settings):
    settings.GPU_BACKEND = "simulated"
    settings.SIMULATED_INVENTORY = ""
    servers, simulated = _worker_servers()
    assert simulated and servers == ["sim-rtx-4x24", "sim-h100-8x80"]


def test_a_host_discovery_error_stops_make_run_with_its_message(monkeypatch):
    def no_nvml() -> tuple[list[str], bool]:
        raise hooks.HostDiscoveryError("GPU_BACKEND=nvml but NVML is not installed: no libnvidia-ml")

    monkeypatch.setattr(hooks.registry(), "host_discovery", no_nvml)
    with pytest.raises(CommandError, match="GPU_BACKEND=nvml but NVML is not installed: no libnvidia-ml"):
        _worker_servers()


def test_no_registered_discovery_means_no_host_workers(monkeypatch):
    monkeypatch.setattr(hooks.registry(), "host_discovery", None)
    assert hooks.worker_hosts() == ([], False)


# --- template slots ----------------------------------------------------------------------------


@pytest.fixture
def empty_slots() -> Iterator[dict]:
    before = hooks.registry_swap(hooks.Registry())
    yield hooks.registry().fillings
    hooks.registry_swap(before)


def _render(source: str, **context) -> str:  # type: ignore[no-untyped-def]
    return Template("{% load slot_tags %}" + source).render(Context(context))


def test_an_empty_slot_renders_nothing(empty_slots):
    assert _render('[{% slot "nobody_fills_this" next="/x" %}]') == "[]"


def test_a_slot_renders_each_filling_with_the_page_context_and_its_values(empty_slots):
    hooks.slot_fill("test", "jobs/_run_buttons.html")
    html = _render('{% slot "test" next="/reservations/" %}', r={"pk": 7})
    assert f'href="{reverse("job_new")}?reservation=7"' in html
    assert 'name="next" value="/reservations/"' in html


def test_a_filling_with_a_context_function_gets_the_page_context(empty_slots):
    hooks.slot_fill("test", "jobs/_run_buttons.html", lambda context: {"r": {"pk": context["n"] + 1}})
    assert "?reservation=42" in _render('{% slot "test" %}', n=41)


def test_filling_a_slot_again_replaces_the_filling(empty_slots):
    hooks.slot_fill("test", "jobs/_run_buttons.html")
    hooks.slot_fill("test", "jobs/_run_buttons.html")
    assert len(hooks.slot_fillings("test")) == 1


def test_the_apps_fill_the_pages_slots():
    """gpus fills portal's profile; jobs fills gpus' booking pages (their AppConfig.ready())."""
    assert [f.template for f in hooks.slot_fillings(hooks.PROFILE_QUOTAS)] == ["gpus/_my_quotas.html"]
    assert [f.template for f in hooks.slot_fillings(hooks.RESERVATION_ACTIONS)] == ["jobs/_run_buttons.html"]


@pytest.mark.django_db
def test_the_profile_shows_the_quotas_gpus_fills_in(client, alice):
    client.force_login(alice)
    html = client.get(reverse("profile")).content.decode()
    assert 'id="quota-vision-lab"' in html and "Teams and quotas" in html


# --- the rest ----------------------------------------------------------------------------------


def test_the_scheduler_channel_keeps_its_redis_name():
    """Renaming it would strand the wake-ups of processes still running the old code."""
    assert QUEUE_SCHEDULER == "queue"


def test_the_mail_tasks_keep_their_names_and_are_one_object():
    app.loader.import_default_modules()
    assert tasks.mail_notification is mail.mail_notification
    for name in ("portal.tasks.mail_notification", "portal.tasks.requeue_stranded_mail"):
        assert name in app.tasks  # beat's schedule and queued messages use these names
