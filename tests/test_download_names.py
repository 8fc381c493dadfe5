"""Names that end up in headers: control characters refused at submit (paths and uploads, form and
API alike), and every download's file name made safe, rows from before the check included."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from django.http.multipartparser import MultiPartParser
from django.urls import reverse
from django.utils.http import content_disposition_header
from rest_framework.test import APIClient

from jobs.logs.store import LogWriter
from jobs.metrics import MetricsRecorder
from jobs.models import Job
from jobs.paths import roots
from jobs.submit import ScriptUpload, job_submit
from portal.errors import Invalid
from tests.factories import job_form_data

pytestmark = pytest.mark.django_db

SCRIPT = b"print('hello')\n"
# A line break (the header splits), quotes and ';' (a second filename), then the other controls.
CONTROLS = ['";\r\nx', "\r", "\n", "\x00", "\t", "\x1b", "\x7f", "\x85"]


@pytest.fixture
def api(alice) -> APIClient:
    client = APIClient()
    client.force_login(alice)  # a session: the pages' downloads too
    return client


def multipart(fields: dict[str, str], file_name: str) -> dict[str, object]:
    """A multipart body with the script named by RFC 2231 (filename*=), so that any character,
    a line break included, can reach the server: the test client would break its own header."""
    boundary = "portal-test-boundary"
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    )
    body += (
        f'--{boundary}\r\nContent-Disposition: form-data; name="script"; '
        f"filename*=utf-8''{quote(file_name, safe='')}\r\nContent-Type: text/x-python\r\n\r\n"
    ).encode()
    body += SCRIPT + f"\r\n--{boundary}--\r\n".encode()
    return {"data": body, "content_type": f"multipart/form-data; boundary={boundary}"}


@pytest.fixture
def names_as_sent(monkeypatch) -> None:
    """Django's parser drops non-printable characters from an upload's name today; the job service
    must refuse them without relying on it (other callers, another parser)."""
    monkeypatch.setattr(MultiPartParser, "sanitize_file_name", lambda self, name: name)


# --- refused at submit --------------------------------------------------------------------------


PATHS = [
    ("script_path", "train{}.py", "The script path holds a control character"),
    ("workdir", "run{}-1", "The working directory holds a control character"),
]


@pytest.mark.parametrize("control", CONTROLS)
@pytest.mark.parametrize(("field", "path", "words"), PATHS)
def test_the_form_refuses_a_path_with_a_control_character_beside_its_field(
    client, alice, booking, sent, field, path, words, control
):
    data = job_form_data(booking, script_path=f"{roots()[0]}/train.py")
    data[field] = f"{roots()[0]}/{path.format(control)}"
    client.force_login(alice)
    response = client.post(reverse("job_new"), data)
    assert response.status_code == 200
    (error,) = response.context["form"].errors[field]
    if control != "\x00":  # NUL: Django's own "Null characters are not allowed." comes first
        assert error.startswith(words) and "without line breaks" in error
    assert not Job.objects.exists()


@pytest.mark.parametrize("control", CONTROLS)
@pytest.mark.parametrize(("field", "path", "words"), PATHS)
def test_the_api_refuses_a_path_with_a_control_character_naming_the_field(
    api, booking, sent, field, path, words, control
):
    data = {"reservation": booking.pk, "script_path": f"{roots()[0]}/train.py"}
    data[field] = f"{roots()[0]}/{path.format(control)}"
    response = api.post("/api/v1/jobs/", data, format="json")
    assert response.status_code == 400
    body = response.json()
    assert list(body["errors"]) == [field]
    if control != "\x00":  # NUL: DRF's own "Null characters are not allowed." comes first
        assert body["errors"][field][0].startswith(words)
    assert not Job.objects.exists()


@pytest.mark.parametrize("control", CONTROLS)
def test_the_form_refuses_an_upload_named_with_a_control_character(
    client, alice, booking, sent, names_as_sent, control
):
    client.force_login(alice)
    response = client.post(reverse("job_new"), **multipart(job_form_data(booking), f"invoice{control}.py"))
    assert response.status_code == 200
    (error,) = response.context["form"].errors["script"]
    assert error.startswith("The script's file name holds a control character")
    assert not Job.objects.exists()


@pytest.mark.parametrize("control", CONTROLS)
def test_the_api_refuses_an_upload_named_with_a_control_character(api, booking, sent, names_as_sent, control):
    sent_body = multipart({"reservation": str(booking.pk)}, f"invoice{control}.py")
    response = api.post("/api/v1/jobs/", **sent_body)
    assert response.status_code == 400
    body = response.json()
    assert list(body["errors"]) == ["script"]
    assert body["detail"].startswith("The script's file name holds a control character")
    assert not Job.objects.exists()


@pytest.mark.parametrize("name", ["..", ".", "runs/..", "runs/", " "])
def test_an_upload_must_be_one_plain_file_name(alice, booking, sent, name):
    with pytest.raises(Invalid, match=r"not a plain file name; name the file like train\.py") as error:
        job_submit(user=alice, reservation=booking, script=ScriptUpload(name=name, content=SCRIPT))
    assert error.value.field == "script"
    assert not Job.objects.exists()


def test_an_upload_name_longer_than_a_job_name_is_refused(alice, booking, sent):
    with pytest.raises(Invalid, match="longer than 200 characters") as error:
        long = ScriptUpload(name="a" * 198 + ".py", content=SCRIPT)
        job_submit(user=alice, reservation=booking, script=long)
    assert error.value.field == "script"


def test_quotes_and_semicolons_in_an_upload_name_arrive_and_download_safely(api, booking, sent):
    """Legal in a Unix file name and harmless once the header is built properly: kept."""
    response = api.post("/api/v1/jobs/", **multipart({"reservation": str(booking.pk)}, 'x"; filename=a.py'))
    assert response.status_code == 201, response.json()
    job = Job.objects.get()
    assert job.name == 'x"; filename=a.py'
    download = api.get(f"/api/v1/jobs/{job.pk}/log/?download=1")
    assert download["Content-Disposition"] == f'attachment; filename="job-{job.pk}-x_filename_a.log"'


# --- downloads of rows from before the check ------------------------------------------------------


@pytest.fixture(
    params=[
        ('evil"\n;invoice.html.py', "evil_invoice.html"),
        ('invoice.html"; x=".py', "invoice.html_x_"),
        ("a\\b\r\nc.py", "a_b_c"),
        ("résumé run.py", "résumé_run"),
        ("\n.py", "_"),
    ]
)
def old_job(request, alice, team, box) -> tuple[Job, str]:
    """A job whose name was stored before names were checked, and the name it downloads as."""
    name, stem = request.param
    job = Job.objects.create(owner=alice, team=team, name=name, server=box[0].server, gpu_uuids=[box[0].uuid])
    writer = LogWriter(job.pk)
    writer.write_line("hello")
    writer.close()
    recorder = MetricsRecorder(job.pk)
    recorder.feed(b'[portal-metrics] {"kind": "epoch", "epoch": 1, "step": 1, "loss": 0.5}\n')
    recorder.flush()
    return job, stem


@pytest.mark.parametrize(
    ("url", "ending"),
    [
        ("/jobs/{pk}/log.txt", ".log"),
        ("/api/v1/jobs/{pk}/log/?download=1", ".log"),
        ("/jobs/{pk}/metrics.csv", "-metrics.csv"),
        ("/api/v1/jobs/{pk}/metrics/?format=csv", "-metrics.csv"),
    ],
)
def test_an_old_job_with_any_name_downloads_under_a_safe_name(api, old_job, url, ending):
    job, stem = old_job
    response = api.get(url.format(pk=job.pk))
    assert response.status_code == 200
    header = response["Content-Disposition"]
    assert header == content_disposition_header(as_attachment=True, filename=f"job-{job.pk}-{stem}{ending}")
    assert header.count(";") == 1 and not set(header) & set("\r\n\\")
    assert header.count('"') in (0, 2)  # the quotes around the name, or filename*= for non-ASCII
    assert b"".join(response.streaming_content)


def test_the_usage_csv_names_its_file_through_the_header_builder(client, alice):
    client.force_login(alice)
    response = client.get(reverse("reports_csv"), {"group_by": "user", "since": "2026-01-01"})
    assert response.status_code == 200
    assert response["Content-Disposition"].startswith('attachment; filename="usage-2026-01-01-')
