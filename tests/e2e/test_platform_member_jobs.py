"""A member's job on a platform shared with `--listen`: submitted with the member's own token,
run by the platform's worker, and never with the platform owner's powers. In its image it
finds neither the owner's GPUFLOW_HOME nor the platform's auth string; a run that would run
as a plain process on the host, name a host path or read another user's Secret is refused
in one sentence before anything is made."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time

import httpx
import pytest

from tests.conftest import free_port
from tests.e2e.helpers import Platform, shared_folder

pytestmark = pytest.mark.e2e

# What the job looks for: the owner's home and the platform's string, in files and in its
# environment; written where its outputs go.
LOOK = """\
import json, os, pathlib, sys
home = pathlib.Path(sys.argv[1])
seen = {}
for name, path in (("auth", home / "platform" / "auth"), ("users", home / "platform" / "users.json")):
    try:
        seen[name] = path.read_text()[:20]
    except OSError as exc:
        seen[name] = type(exc).__name__
try:
    seen["home"] = sorted(os.listdir(home))
except OSError as exc:
    seen["home"] = type(exc).__name__
seen["env"] = sorted(k for k in os.environ if "AUTH" in k or k.startswith("PREFECT_API"))
out = pathlib.Path(os.environ["GPUFLOW_OUTPUT_DIR"])
(out / "seen.json").write_text(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def shared(image_registry):
    folder = shared_folder("gpuflow-members-")
    platform = Platform(folder / "home", free_port())
    platform.env.update(image_registry.env)
    up = platform.gpuflow(
        "platform", "up", "--port", str(platform.port), "--listen", "0.0.0.0", timeout=300
    )
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        platform.tokens = {}
        for name in ("mia", "max"):
            made = platform.gpuflow("platform", "user", "add", name, "--role", "member")
            assert made.returncode == 0, made.stderr
            platform.tokens[name] = made.stdout.strip()
        platform.cert = platform.home / "platform" / "tls" / "cert.pem"
        platform.https = f"https://127.0.0.1:{platform.port}/api"
        platform.image = {"ref": image_registry.ref("py")}
        yield platform
    finally:
        platform.gpuflow("platform", "down", timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


def submit(shared: Platform, who: str, spec: dict) -> dict:
    """Run the deployment `gpu-pipeline/command-local` with `spec` as `who` (as `prefect
    deployment run` does, with the member's own auth string); return the run once final."""
    headers = {"Authorization": "Basic " + base64.b64encode(shared.tokens[who].encode()).decode()}
    with httpx.Client(base_url=shared.https, verify=str(shared.cert), headers=headers) as api:
        deployment = api.get("/deployments/name/gpu-pipeline/command-local").json()
        for _ in range(10):  # as Prefect's client does: a busy SQLite answers 503, retried
            made = api.post(
                f"/deployments/{deployment['id']}/create_flow_run",
                json={"parameters": {"spec": spec}},
            )
            if made.status_code != 503:
                break
            time.sleep(1)
        assert made.status_code == 201, made.text
        run = made.json()
        assert f"owner:{who}" in run["tags"]
        deadline = time.monotonic() + 300
        while run["state_type"] not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            assert time.monotonic() < deadline, run["state"]
            time.sleep(0.5)
            run = api.get(f"/flow_runs/{run['id']}").json()
        return run


def test_a_members_job_in_its_image_sees_nothing_of_the_owners(shared):
    spec = {
        "name": "peek",
        "image": shared.image,
        "job": {"kind": "command", "command": ["python3", "-c", LOOK, str(shared.home)]},
    }
    run = submit(shared, "mia", spec)
    assert run["state_type"] == "COMPLETED", run["state"]
    (folder,) = (shared.home / "runs").glob(f"peek-{run['id'][:8]}")
    seen = json.loads((folder / "outputs" / "seen.json").read_text())
    assert seen["auth"] == "FileNotFoundError" and seen["users"] == "FileNotFoundError"
    assert "platform" not in seen["home"]  # at most the run's own folder is mounted there
    assert seen["env"] == []
    assert shared.auth not in json.dumps(seen)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"image": None}, "image: mia is a member of this shared platform, and a member's job"),
        ({"storage": {"artifacts": "file:///tmp"}}, "storage.artifacts: mia is a member"),
        ({"secret_env": {"T": "max-token"}}, "secret_env.T: Secret block 'max-token' is not"),
    ],
)
def test_a_member_run_asking_for_the_owners_powers_is_one_sentence(shared, change, said):
    spec = {"name": "ask", "image": shared.image, "job": {"kind": "command", "command": ["true"]}}
    spec.update(change)
    spec = {k: v for k, v in spec.items() if v is not None}
    run = submit(shared, "mia", spec)
    assert run["state_type"] == "FAILED"
    assert said in run["state"]["message"], run["state"]["message"]
    containers = subprocess.run(
        ["podman", "ps", "-a", "--filter", "label=io.gpuflow.cluster", "--format", "{{.Names}}"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert run["id"][:8] not in containers
