"""The container image catalogue on the portal's side (issue 34): GET /api/v1/images/, the image
in the job form, the API and labs, checked by one rule (jobs.images.image_check) with nothing
written on a refusal; the queue placing a job in an image only where it can run; the host's
containers report at its worker's start; the pre-pull (manage.py images_pull, the admin's action,
the task on the host's queue); "image X" beside a job's processes on the dashboard."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from gpus.booking import reservation_create
from gpus.models import ContainerImage, GPUProcess, ImagePull, Server
from gpus.services import server_report_ingest
from jobs.host import containers
from jobs.host.pickup import slots_report
from jobs.host.worker import containers_report
from jobs.images import images_pull_send
from jobs.models import InteractiveSession, Job
from jobs.queue.rules import NO_IMAGE_SERVER
from jobs.queue.scheduler import schedule_pass
from jobs.sessions.services import session_start
from jobs.submit import ScriptUpload, job_submit
from jobs.tasks import pull_images_now
from portal.errors import Invalid
from tests.factories import job_form_data, make_snapshot, queue_job
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db

SCRIPT = b"print('hi')\n"
PODMAN = "podman 4.3.1 (runc)"
NO_PODMAN = "podman is not installed on this host (apt install podman runc uidmap)."


@pytest.fixture
def box2(box) -> Server:
    """A second server, box2 (two cards), where containers do not work."""
    server_report_ingest(snapshot=make_snapshot("box2", gpus=2))
    slots_report("box2", slots=64, now=timezone.now())
    Server.objects.filter(name="box1").update(containers_ok=True, containers_detail=PODMAN)
    Server.objects.filter(name="box2").update(containers_ok=False, containers_detail=NO_PODMAN)
    return Server.objects.get(name="box2")


@pytest.fixture
def images(box2) -> dict:
    """tf-2.17 on box1 and box2; pytorch-2.5 on box2 only (containers off there); old-1 nowhere."""
    box1 = Server.objects.get(name="box1")
    tf = ContainerImage.objects.create(
        name="tf-2.17", reference="registry.lab.example/tf:2.17", description="TensorFlow 2.17, CUDA 12"
    )
    tf.servers.set([box1, box2])
    torch = ContainerImage.objects.create(name="pytorch-2.5", reference="/srv/images/pytorch", network=True)
    torch.servers.set([box2])
    old = ContainerImage.objects.create(name="old-1", reference="docker-archive:/srv/old.tar")
    return {"tf": tf, "torch": torch, "old": old}


@pytest.fixture
def api(alice) -> APIClient:
    client = APIClient()
    client.force_authenticate(alice)
    return client


@pytest.fixture
def pulls_sent(monkeypatch) -> list[tuple[list, str]]:
    """(args, queue) of each pull sent to a host: no broker here."""
    sent: list[tuple[list, str]] = []
    monkeypatch.setattr("jobs.tasks.pull_images.apply_async", lambda args, queue: sent.append((args, queue)))
    return sent


def _submit(api: APIClient, **data) -> tuple[int, dict]:
    upload = SimpleUploadedFile("train.py", SCRIPT)
    response = api.post("/api/v1/jobs/", {"script": upload, **data}, format="multipart")
    return response.status_code, response.json()


# --- the list ------------------------------------------------------------------------------------


def test_it_lists_the_images_with_their_servers_and_where_containers_work(api, images):
    listed = api.get("/api/v1/images/").json()
    assert [i["name"] for i in listed] == ["old-1", "pytorch-2.5", "tf-2.17"]
    tf = listed[2]
    assert tf == {
        "name": "tf-2.17",
        "reference": "registry.lab.example/tf:2.17",
        "description": "TensorFlow 2.17, CUDA 12",
        "servers": ["box1", "box2"],
        "network": False,
        "has_jupyterlab": False,
        "containers_ok": {"box1": True, "box2": False},
    }
    assert [i["name"] for i in api.get("/api/v1/images/?server=box2").json()] == ["pytorch-2.5", "tf-2.17"]
    assert api.get("/api/v1/images/?server=nowhere").json() == []
    assert api.get("/api/v1/images/pytorch-2.5/").json()["network"] is True
    assert APIClient().get("/api/v1/images/").status_code in (401, 403)
    servers = {s["name"]: s for s in api.get("/api/v1/servers/").json()}
    assert (servers["box2"]["containers_ok"], servers["box2"]["containers_detail"]) == (False, NO_PODMAN)


# --- submissions -----------------------------------------------------------------------------------


def test_the_job_form_offers_only_images_that_can_run_and_submits_one(client, alice, booking, images, sent):
    client.force_login(alice)
    page = client.get(reverse("job_new"))
    choices = page.context["form"].fields["image"].choices
    assert choices == [
        ("", "None: run on the host"),
        ("tf-2.17", "tf-2.17 — TensorFlow 2.17, CUDA 12 (on box1)"),
    ]
    assert 'name="image"' in page.content.decode()

    data = job_form_data(booking, script=SimpleUploadedFile("train.py", SCRIPT), image="tf-2.17")
    response = client.post(reverse("job_new"), data)
    job = Job.objects.get()
    assert response.status_code == 302 and job.image == images["tf"]
    detail = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert re.search(r'id="job-image">tf-2.17 · TensorFlow 2.17, CUDA 12', detail)


def test_the_form_hides_the_field_where_no_image_can_run(client, alice, booking):
    client.force_login(alice)
    assert 'name="image"' not in client.get(reverse("job_new")).content.decode()


def test_the_form_shows_a_refusal_beside_the_image_and_writes_nothing(client, alice, booking, images):
    client.force_login(alice)
    data = job_form_data(booking, script=SimpleUploadedFile("train.py", SCRIPT), image="pytorch-2.5")
    response = client.post(reverse("job_new"), data)
    assert response.status_code == 200
    assert response.context["form"].errors["image"], response.context["form"].errors
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("image", "card", "words"),
    [
        ("nope", 0, "There is no image 'nope'; choose one of tf-2.17 (on box1)."),
        (
            "pytorch-2.5",
            0,
            "box1 does not have image pytorch-2.5; choose one of tf-2.17 (on box1), or book a server "
            "where pytorch-2.5 runs:",
        ),
        ("tf-2.17", "box2", f"Containers do not work on box2 ({NO_PODMAN}), so no image runs there"),
    ],
)
def test_the_api_refuses_an_image_that_cannot_run_there_naming_the_field(
    api, alice, images, image, card, words
):
    gpu = "GPU-box2-00" if card == "box2" else "GPU-box1-00"
    booking = reservation_create(user=alice, gpus=[gpu], memory_mb=8192)
    status, body = _submit(api, reservation=booking.pk, image=image)
    assert status == 400, body
    assert list(body["errors"]) == ["image"] and body["errors"]["image"][0].startswith(words), body
    assert not Job.objects.exists()


def test_the_api_runs_a_job_in_an_image_and_shows_it(api, alice, booking, images, sent):
    status, body = _submit(api, reservation=booking.pk, image="tf-2.17")
    assert status == 201, body
    assert body["image"] == "tf-2.17" and Job.objects.get().image == images["tf"]
    assert api.get(f"/api/v1/jobs/{body['id']}/").json()["image"] == "tf-2.17"


def test_a_queued_job_in_an_image_is_refused_where_it_cannot_run(alice, images):
    with pytest.raises(Invalid, match="Containers do not work on box2") as refused:
        queue_job(alice, server="box2", image="tf-2.17")
    assert (
        refused.value.field == "image" and "queue it on a server where tf-2.17 runs" in refused.value.message
    )
    with pytest.raises(Invalid, match=re.escape("No server can run image pytorch-2.5 now")) as refused:
        queue_job(alice, image="pytorch-2.5")
    assert refused.value.errors == {"image": [refused.value.message]}
    assert not Job.objects.exists()


def test_the_queue_places_a_job_in_an_image_only_where_it_can_run(
    alice, images, sent, django_capture_on_commit_callbacks
):
    # box2 has both images and working containers now; box1 (which has tf-2.17 too) does not.
    Server.objects.filter(name="box2").update(containers_ok=True)
    Server.objects.filter(name="box1").update(containers_ok=False)
    job = queue_job(alice, gpus=2, image="tf-2.17")
    with django_capture_on_commit_callbacks(execute=True):
        schedule_pass()
    job.refresh_from_db()
    assert job.status == Job.Status.QUEUED and job.server.name == "box2"
    assert sent == [(job.pk, "host.box2")]

    # Containers stop working on box2 after a submit: the job waits, and says why.
    Server.objects.filter(name="box2").update(containers_ok=False)
    later = Job.objects.create(
        owner=alice,
        team=job.team,
        name="later.py",
        script_source="print(1)\n",
        queued=True,
        status=Job.Status.PENDING,
        gpu_count=1,
        time_limit_minutes=10,
        image=images["tf"],
    )
    schedule_pass()
    later.refresh_from_db()
    assert later.status == Job.Status.PENDING and later.pending_reason == "resources"
    assert later.message == f"Waiting: {NO_IMAGE_SERVER}"


# --- labs ------------------------------------------------------------------------------------------


@pytest.fixture
def lab_image(images) -> ContainerImage:
    """lab-1 on box1 and box2, marked as having JupyterLab (tf-2.17 and the rest have none)."""
    image = ContainerImage.objects.create(name="lab-1", reference="/srv/images/lab", has_jupyterlab=True)
    image.servers.set(Server.objects.filter(name__in=["box1", "box2"]))
    return image


def test_a_lab_opens_only_in_an_image_with_jupyterlab_naming_those_that_have_it(alice, booking, lab_image):
    with pytest.raises(Invalid, match=r"Image tf-2\.17 has no JupyterLab") as refused:
        session_start(user=alice, reservation=booking.pk, kind="jupyterlab", image="tf-2.17")
    assert refused.value.field == "image" and "choose one of lab-1 (on box1)" in str(refused.value)
    with pytest.raises(Invalid, match="There is no image 'nope'") as refused:
        session_start(user=alice, reservation=booking.pk, kind="jupyterlab", image="nope")
    assert refused.value.field == "image"
    with pytest.raises(Invalid, match="An image is for jobs and labs") as refused:
        session_start(
            user=alice, reservation=booking.pk, kind="exec", host="box1", command=["python"], image="lab-1"
        )
    assert refused.value.field == "image"
    assert not InteractiveSession.objects.exists()

    session, _ = session_start(user=alice, reservation=booking.pk, kind="jupyterlab", image="lab-1")
    assert session.image == lab_image


def test_a_lab_image_not_runnable_on_the_booked_server_is_refused(alice, box2, lab_image):
    """box2 has lab-1, but its containers do not work: refused, saying what to do."""
    booking = reservation_create(user=alice, gpus=[box2.gpus.order_by("index").first().uuid], memory_mb=8192)
    with pytest.raises(Invalid, match="Containers do not work on box2") as refused:
        session_start(user=alice, reservation=booking.pk, kind="jupyterlab", image="lab-1")
    assert refused.value.field == "image" and "open JupyterLab on a booking of a server where" in str(
        refused.value
    )
    assert not InteractiveSession.objects.exists()


def test_the_booking_page_offers_the_lab_images_and_its_form_opens_one(client, alice, booking, lab_image):
    """What a browser sends: the button's form, with the image chosen in its select."""
    client.force_login(alice)
    page = client.get(reverse("reservation_detail", args=[booking.pk])).content.decode()
    select = re.search(r'<select name="image".*?</select>', page, re.S)
    assert select is not None, page
    assert re.findall(r'<option value="([^"]*)"', select.group()) == ["", "lab-1"]  # not tf-2.17: no lab
    response = client.post(reverse("session_new"), {"reservation": str(booking.pk), "image": "lab-1"})
    session = InteractiveSession.objects.get()
    assert response.status_code == 302 and session.image == lab_image and session.kind == "jupyterlab"


def test_the_sessions_api_opens_a_lab_in_an_image_with_jupyterlab_only(api, booking, lab_image):
    response = api.post(
        "/api/v1/sessions/", {"kind": "jupyterlab", "reservation": booking.pk, "image": "tf-2.17"}
    )
    assert response.status_code == 400 and list(response.json()["errors"]) == ["image"]
    assert "has no JupyterLab (only jobs run in it); choose one of lab-1 (on box1)" in str(
        response.json()["errors"]["image"]
    )
    assert not InteractiveSession.objects.exists()
    response = api.post(
        "/api/v1/sessions/", {"kind": "jupyterlab", "reservation": booking.pk, "image": "lab-1"}
    )
    assert response.status_code == 201 and response.json()["image"] == "lab-1"
    listed = {i["name"]: i["has_jupyterlab"] for i in api.get("/api/v1/images/").json()}
    assert listed == {"lab-1": True, "old-1": False, "pytorch-2.5": False, "tf-2.17": False}


def test_the_sessions_api_refuses_a_lab_image_the_booked_server_does_not_have(api, booking, lab_image):
    elsewhere = ContainerImage.objects.create(name="lab-2", reference="/srv/images/lab2", has_jupyterlab=True)
    elsewhere.servers.set(Server.objects.filter(name="box2"))
    said = {}
    for image in ("lab-2", "nope"):
        response = api.post(
            "/api/v1/sessions/", {"kind": "jupyterlab", "reservation": booking.pk, "image": image}
        )
        assert response.status_code == 400 and list(response.json()["errors"]) == ["image"], response.json()
        said[image] = str(response.json()["errors"]["image"])
    assert "box1 does not have image lab-2; choose one of lab-1 (on box1)" in said["lab-2"], said
    assert "There is no image 'nope'" in said["nope"]
    assert "tf-2.17" not in said["lab-2"] + said["nope"]  # no JupyterLab: a lab's refusal never offers it
    assert not InteractiveSession.objects.exists()
    blank = api.post("/api/v1/sessions/", {"kind": "jupyterlab", "reservation": booking.pk, "image": " "})
    assert blank.status_code == 201 and blank.json()["image"] is None  # blank: on the host, as none


# --- the host's report and the pre-pull ------------------------------------------------------------


def test_the_worker_start_records_whether_containers_work(box, monkeypatch):
    monkeypatch.setattr(containers, "runtime_status", lambda: (True, PODMAN))
    assert containers_report("box1") == (True, PODMAN)
    box1 = Server.objects.get(name="box1")
    assert (box1.containers_ok, box1.containers_detail) == (True, PODMAN)

    def broken() -> tuple[bool, str]:
        raise OSError("podman hung")

    monkeypatch.setattr(containers, "runtime_status", broken)
    containers_report("box1")
    box1.refresh_from_db()
    assert not box1.containers_ok and box1.containers_detail == "The check failed: OSError('podman hung')"


def test_the_dashboard_shows_containers_and_the_image_beside_a_jobs_process(
    client, alice, booking, images, sent
):
    job = job_submit(
        user=alice, reservation=booking, script=ScriptUpload(name="train.py", content=SCRIPT), image="tf-2.17"
    )
    GPUProcess.objects.filter(gpu_id=booking.allocations.get().gpu_id).update(job_id=job.pk)
    client.force_login(alice)
    html = client.get(reverse("dashboard_servers")).content.decode()
    assert f'job {job.pk}</a> · <span class="image">image tf-2.17</span>' in html
    assert f"Containers: {PODMAN}</span>" in html
    assert f"Containers: not available — {NO_PODMAN}</span>" in html
    gpus = APIClient()
    gpus.force_authenticate(alice)
    (process,) = gpus.get("/api/v1/gpus/GPU-box1-00/").json()["processes"]
    assert (process["job"], process["image"]) == (f"job {job.pk}", "tf-2.17")


def test_images_pull_sends_one_message_per_server_that_has_them(images, pulls_sent):
    out = StringIO()
    call_command("images_pull", stdout=out)
    box1, box2 = Server.objects.get(name="box1"), Server.objects.get(name="box2")
    tf, torch = images["tf"], images["torch"]
    assert pulls_sent == [([box1.pk, [tf.pk]], "host.box1"), ([box2.pk, [torch.pk, tf.pk]], "host.box2")]
    assert out.getvalue().splitlines() == [
        "Sent: box1: tf-2.17 (sent to host.box1)",
        "Sent: box2: pytorch-2.5, tf-2.17 (sent to host.box2)",
    ]
    pulls_sent.clear()
    call_command("images_pull", "--image", "tf-2.17", "--server", "box2", stdout=StringIO())
    assert pulls_sent == [([box2.pk, [tf.pk]], "host.box2")]
    with pytest.raises(
        CommandError, match=re.escape("No image named nope; choose from old-1, pytorch-2.5, tf-2.17")
    ):
        call_command("images_pull", "--image", "nope")


def test_the_pull_task_pulls_each_image_of_its_server_and_records_how_it_went(images, monkeypatch):
    said: list[str] = []

    def pull(reference: str, say, account=None, name="") -> None:  # type: ignore[no-untyped-def]
        said.append(reference)
        if reference.startswith("/"):
            raise containers.ContainerError(f"{reference} is not a folder on this host; create it.")
        say("pulling tf-2.17: 1.2 / 4.8 GB")
        say("pulled")

    monkeypatch.setattr(containers, "image_pull", pull)
    box2 = Server.objects.get(name="box2")
    pull_images_now(box2.pk, [images["torch"].pk, images["tf"].pk, images["old"].pk])  # old-1 is not box2's
    assert said == ["/srv/images/pytorch", "registry.lab.example/tf:2.17"]  # one failure stops nothing
    rows = {p.image.name: (p.ok, p.detail) for p in ImagePull.objects.filter(server=box2)}
    assert rows == {
        "pytorch-2.5": (False, "/srv/images/pytorch is not a folder on this host; create it."),
        "tf-2.17": (True, "pulled"),
    }
    out = StringIO()
    call_command("images_pull", "--here", "--server", "box1", stdout=out)
    assert out.getvalue() == "tf-2.17: pulled: pulled\n"


def test_the_admin_pulls_on_every_host_now_and_shows_the_last_pulls(client, admin_user, images, pulls_sent):
    ImagePull.objects.create(
        image=images["tf"], server=Server.objects.get(name="box1"), ok=True, detail="pulled"
    )
    client.force_login(admin_user)
    changelist = reverse("admin:gpus_containerimage_changelist")
    page = client.get(changelist).content.decode()
    assert "box1: ok" in page and "box1, box2" in page
    response = client.post(
        changelist, {"action": "pull_now", "_selected_action": [images["tf"].pk], "index": 0}, follow=True
    )
    assert "Sent: box1: tf-2.17 (sent to host.box1)" in response.content.decode()
    assert [queue for _, queue in pulls_sent] == ["host.box1", "host.box2"]
    server_page = client.get(reverse("admin:gpus_server_change", args=[images["tf"].servers.first().pk]))
    assert PODMAN in server_page.content.decode()


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_hosts_worker_reports_its_containers_and_takes_its_pulls(start_worker, alice):
    """A real worker of sim-rtx-4x24 (a server of the simulated inventory: a worker for any other
    refuses to start): at its start it writes what the runtime check found, and a pull sent to its
    queue reaches it and is recorded, whatever the pull's outcome on this machine."""
    server_report_ingest(snapshot=make_snapshot("sim-rtx-4x24", gpus=1, simulated=True))
    image = ContainerImage.objects.create(name="tf-2.17", reference="registry.lab.example/tf:2.17")
    image.servers.set(Server.objects.filter(name="sim-rtx-4x24"))
    start_worker("sim-rtx-4x24", containers=True)
    expected = containers.runtime_status()[1]
    wait_for(lambda: Server.objects.get(name="sim-rtx-4x24").containers_detail, what="the containers report")
    assert Server.objects.get(name="sim-rtx-4x24").containers_detail == expected
    (sent,) = images_pull_send(images=["tf-2.17"])
    assert (sent.server, sent.queue, sent.error) == ("sim-rtx-4x24", "host.sim-rtx-4x24", "")
    pulled = wait_for(lambda: ImagePull.objects.filter(image=image).first(), timeout=60, what="the pull")
    assert pulled.server.name == "sim-rtx-4x24" and pulled.detail


@pytest.mark.parametrize(
    "reference",
    # "relative/rootfs" would be a registry's repository (docker.io/relative/rootfs): taken as one
    ["--privileged", "-v=/:/host", "tf 2.17", "/", "/srv/../etc", "/srv/x/", "oci-archive:x.tar", "a\nb"],
)
def test_a_reference_podman_could_take_for_an_option_or_two_arguments_is_refused(reference, db):
    from django.core.exceptions import ValidationError

    image = ContainerImage(name="bad", reference=reference)
    with pytest.raises(ValidationError) as refused:
        image.full_clean()
    assert "reference" in refused.value.message_dict  # named, with the three shapes it may take
    assert "oci-archive:/path" in refused.value.message_dict["reference"][0]


@pytest.mark.parametrize(
    "reference",
    ["/srv/images/tf-2.17", "oci-archive:/srv/i/tf.tar", "nvcr.io/nvidia/tf:24.01-py3", "python:3.11"],
)
def test_the_three_shapes_of_reference_are_taken(reference, db):
    ContainerImage(name="good", reference=reference).full_clean()


def test_the_lab_images_cost_one_query_per_page_not_per_booking(client, alice, box, lab_image):
    """My reservations has an *Open JupyterLab* button per active booking: the images it offers
    are read once for the page."""
    client.force_login(alice)
    reservation_create(user=alice, gpus=[box[0].uuid], memory_mb=8192)
    with CaptureQueriesContext(connection) as one:
        page = client.get(reverse("my_reservations")).content.decode()
    assert page.count('<option value="lab-1"') == 1
    for card in box[1:3]:
        reservation_create(user=alice, gpus=[card.uuid], memory_mb=8192)
    with CaptureQueriesContext(connection) as three:
        page = client.get(reverse("my_reservations")).content.decode()
    assert page.count('<option value="lab-1"') == 3
    assert len(three) == len(one), [q["sql"] for q in three.captured_queries]
