"""Two teams sharing a platform's 4 fake GPUs by quota: team vision borrows the GPUs team
nlp leaves idle; when nlp's run arrives, vision's borrowed run is stopped through the job
contract (SIGTERM, its checkpoint, exit 75) and waits again; nlp's run starts; vision's
resumes from its checkpoint once the GPUs are free. Every admission decision is an event
with its reason, `gpuflow ls` shows the queue, and nothing the jobs wrote is lost."""

from __future__ import annotations

import base64
import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import FAKES, free_port
from tests.e2e.helpers import Platform, shared_folder

pytestmark = pytest.mark.e2e

# A job that counts steps, keeps its step in a checkpoint outside its workspace, ends when
# its `done` file appears, and on SIGTERM saves and exits 75 (the job contract).
STEPS = """\
import json, os, pathlib, signal, sys, time
folder = pathlib.Path(sys.argv[1]); folder.mkdir(parents=True, exist_ok=True)
ckpt = folder / "ckpt"
step = int(ckpt.read_text()) if ckpt.exists() else 0
with open(folder / "starts", "a") as starts:
    starts.write(f"{step}\\n")
def save(*_):
    ckpt.write_text(str(step)); sys.exit(75)
signal.signal(signal.SIGTERM, save)
print("started at step", step, flush=True)
while not (folder / "done").exists():
    step += 1
    ckpt.write_text(str(step))
    time.sleep(0.1)
print("finished at step", step, flush=True)
"""


@pytest.fixture(scope="module")
def platform():
    folder = shared_folder("gpuflow-quotas-")
    platform = Platform(folder / "home", free_port())
    platform.env |= {"FAKE_NVML_GPUS": "4", "PYTHONPATH": str(FAKES)}
    platform.folder = folder
    up = platform.gpuflow("platform", "up", "--port", str(platform.port), timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        platform.tokens = {}
        for name, team in (("ana", "vision"), ("bo", "nlp")):
            made = platform.gpuflow(
                "platform", "user", "add", name, "--role", "admin", "--team", team
            )
            assert made.returncode == 0, made.stderr
            platform.tokens[name] = made.stdout.strip()
            assert platform.gpuflow("platform", "quota", "set", team, "--gpus", "2").returncode == 0
        yield platform
    finally:
        platform.gpuflow("platform", "down", timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


class Api:
    def __init__(self, platform: Platform, who: str) -> None:
        token = base64.b64encode(platform.tokens[who].encode()).decode()
        self.client = httpx.Client(
            base_url=platform.api, headers={"Authorization": f"Basic {token}"}, timeout=30
        )

    def submit(self, name: str, folder: Path, gpus: int = 2) -> str:
        deployment = self.client.get("/deployments/name/gpu-pipeline/command-local").json()
        spec = {
            "name": name,
            "resources": {"gpus": gpus},
            "limits": {"stop_grace_s": 20},
            "job": {"kind": "command", "command": ["python3", "-c", STEPS, str(folder)]},
        }
        for _ in range(10):  # as Prefect's client does: a busy SQLite answers 503, retried
            made = self.client.post(
                f"/deployments/{deployment['id']}/create_flow_run",
                json={"parameters": {"spec": spec}},
            )
            if made.status_code != 503:
                break
            time.sleep(1)
        assert made.status_code == 201, made.text
        return made.json()["id"]

    def run(self, run_id: str) -> dict:
        return self.client.get(f"/flow_runs/{run_id}").json()


def until(what: str, check, seconds: float = 180.0):
    deadline = time.monotonic() + seconds
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what} within {seconds:.0f} s"
        time.sleep(0.3)
    return value


def admission_events(platform: Platform, run_id: str, done) -> list[str]:
    """The admission events about `run_id`, oldest first, once `done(them)` holds (events
    are stored in batches: they arrive a little after the decisions)."""
    return until(
        f"the admission events of {run_id}",
        lambda: (said := _admission_events(platform, run_id)) and done(said) and said,
        seconds=120,
    )


def _admission_events(platform: Platform, run_id: str) -> list[str]:
    ana = Api(platform, "ana")
    answer = ana.client.post(
        "/events/filter",
        json={
            "filter": {
                "event": {"prefix": ["gpuflow.admission."]},
                "any_resource": {"id": [f"gpuflow.run.{run_id}"]},
                "occurred": {"since": "2000-01-01T00:00:00Z"},
            },
            "limit": 50,
        },
    ).json()
    return [
        f"{e['event'].rsplit('.', 1)[1]}: {e['payload']['reason']}"
        for e in sorted(answer["events"], key=lambda e: e["occurred"])
    ]


def test_a_borrower_yields_through_the_job_contract_and_resumes_from_its_checkpoint(platform):
    ana, bo = Api(platform, "ana"), Api(platform, "bo")
    own, lent, theirs = (platform.folder / name for name in ("own", "lent", "theirs"))
    first = ana.submit("vision-own", own)
    until("vision's own run starting", lambda: (own / "starts").exists())
    borrowing = ana.submit("vision-borrows", lent)
    until("vision's second run borrowing nlp's idle GPUs", lambda: (lent / "starts").exists())
    until("a few steps", lambda: (lent / "ckpt").exists() and int((lent / "ckpt").read_text()) > 3)
    # nlp's run comes: vision's borrowed run saves, exits 75 and waits again
    arriving = bo.submit("nlp-run", theirs)
    until("nlp's run starting", lambda: (theirs / "starts").exists())
    saved = int((lent / "ckpt").read_text())
    assert saved > 3
    parked = admission_events(platform, arriving, lambda said: True)[0]
    assert parked.startswith("queued: team nlp's quota (2 GPUs anywhere) is lent out"), parked
    # more of vision's runs wait parked: their flow runs hold no process and no worker slot
    more = ana.submit("vision-more", platform.folder / "more")
    waits = until(
        "vision's third run parked",
        lambda: (r := ana.run(more))["state_name"] == "AwaitingQuota" and r,
    )
    assert waits["state_type"] == "SCHEDULED" and waits["labels"]["gpuflow.queue"] >= 1
    waiting = until(
        "vision's run back in line",
        lambda: (r := ana.run(borrowing))["labels"].get("gpuflow.queue") == 1 and r,
    )
    assert waiting["state_type"] == "RUNNING"
    assert "team vision holds 2 of its 2 GPUs anywhere" in waiting["labels"]["gpuflow.queue.reason"]
    listed = platform.gpuflow("ls")
    assert "Queued (1)" in listed.stdout and "queued 1: " in listed.stdout, listed.stdout
    # nlp's run ends: vision's resumes from its checkpoint
    (theirs / "done").write_text("")
    until("nlp's run done", lambda: ana.run(arriving)["state_type"] == "COMPLETED")
    until("vision's run resumed", lambda: len((lent / "starts").read_text().split()) == 2)
    starts = [int(step) for step in (lent / "starts").read_text().split()]
    assert starts[0] == 0 and starts[1] >= saved  # from its checkpoint, nothing redone
    for folder in (lent, own, platform.folder / "more"):
        folder.mkdir(exist_ok=True)
        (folder / "done").write_text("")
    until("vision's third run started", lambda: (platform.folder / "more" / "starts").exists())
    for run in (borrowing, first, more):
        ended = lambda r=run: ana.run(r)["state_type"] in ("COMPLETED", "FAILED")  # noqa: E731
        until("the run ending", ended)
        assert ana.run(run)["state_type"] == "COMPLETED", ana.run(run)["state"]
    said = admission_events(
        platform, borrowing, lambda said: len(said) >= 4 and said[-1].startswith("borrowed: ")
    )
    assert said[0].startswith("borrowed: borrows 2 idle GPUs anywhere beyond team vision's 2")
    assert any(s.startswith("yield: gives its borrowed GPUs back to team nlp") for s in said), said
    assert any(s.startswith("queued: team vision holds 2 of its 2 GPUs") for s in said), said
    assert said[-1].startswith("borrowed: "), said
    theirs_said = admission_events(
        platform, arriving, lambda said: said[-1].startswith("admitted: ")
    )
    assert theirs_said[-1] == "admitted: within team nlp's quota", theirs_said
    ledger = json.loads((platform.home / "platform" / "admission.json").read_text())
    assert ledger["entries"] == []  # nothing holds or waits once every run ended
