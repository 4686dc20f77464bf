"""The local platform for real: `gpuflow platform up` (a Prefect server on loopback, pools,
the `gpu` limit, blocks, prefect.yaml's deployments, a process worker), runs started the
ways people start them (`prefect deployment run --watch`, `gpuflow submit`, an event), the
UI in headless Chromium, and `gpuflow platform down` stopping everything by PID."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import psutil
import pytest

from tests.conftest import free_port
from tests.e2e.browser import CHROMIUM, ui_page
from tests.e2e.helpers import (
    SHUT_OUT,
    Platform,
    nothing_left,
    outsider,
    process_gone,
    shared_folder,
    squatted,
    wider_than_private,
)

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def platform():
    shared = shared_folder("gpuflow-platform-")  # a home another local user could reach
    platform = Platform(shared / "home", free_port())
    started = time.monotonic()
    up = platform.gpuflow("platform", "up", "--port", str(platform.port), timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    platform.up_output, platform.up_seconds = up.stdout, time.monotonic() - started
    yield platform
    platform.gpuflow("platform", "down", timeout=120)
    shutil.rmtree(shared, ignore_errors=True)


def test_up_brings_server_pools_limit_blocks_deployments_and_worker(platform):
    assert f"UI {platform.ui}" in platform.up_output
    processes = platform.state()["processes"]
    assert {"server", "worker"} <= set(processes)
    assert all(psutil.pid_exists(p["pid"]) for p in processes.values())
    with platform.client() as client:
        pools = {p.name: p.type for p in client.read_work_pools()}
        assert pools["gpuflow-local"] == "process"
        assert pools["gpuflow-gpu-k8s"] == "gpuflow-kubernetes"
        limit = client.read_global_concurrency_limit_by_name("gpu")
        from gpuflow.tasks import nvml

        assert limit.limit == len(nvml.query().gpus)
        deployments = {d.name for d in client.read_deployments()}
        assert {"command-local", "render-local", "prepare-dataset-local"} <= deployments
        # no cluster was named: the Kubernetes deployments wait for `up --kubeconfig`
        assert not {d for d in deployments if d.endswith("-k8s")}
        types = {b.slug for b in client.read_block_types()}
        assert {"gpuflow-local-gpu-host", "gpuflow-gpu-price-table"} <= types
    again = platform.gpuflow("platform", "up", "--port", str(platform.port))
    assert again.returncode == 0 and "already running" in again.stdout
    elsewhere = platform.gpuflow("platform", "up", "--port", str(platform.port + 1))
    assert elsewhere.returncode == 1, elsewhere.stdout + elsewhere.stderr
    assert (
        f"the platform already runs on port {platform.port}, not {platform.port + 1}: --port"
        f" {platform.port + 1} was not used; run `gpuflow platform down`, then `up --port"
    ) in elsewhere.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another local user")
def test_nobody_else_reaches_the_platform_its_secrets_or_its_files(platform):
    """Another local user (nobody) and a page that rebinds a name to 127.0.0.1 get nothing:
    not the runs' folder, not the auth string, no block secret, no deployment to start."""
    assert outsider(platform.home, platform.api, platform.home / "platform" / "auth") == SHUT_OUT
    assert wider_than_private(platform.home) == []
    # the auth string is in no process's argv, and in none of the platform's logs
    secret = platform.auth
    assert secret and len(secret) > 40
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            assert secret not in " ".join(proc.cmdline())
    for log in (platform.home / "platform").glob("*.log"):
        assert secret not in log.read_text(errors="replace"), log
    # a page of another origin: no CORS grant; the UI's own origin: granted
    import httpx

    for origin, granted in [("http://attacker.example", None), (platform.ui, platform.ui)]:
        answer = httpx.options(
            f"{platform.api}/deployments/filter",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        )
        assert answer.headers.get("access-control-allow-origin") == granted, origin


def latest_run(platform, deployment_name: str, completed: bool = False):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with platform.client() as client:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment_name])),
            sort=FlowRunSort.START_TIME_DESC,
            limit=20,
        )
    if completed:
        runs = [r for r in runs if r.state.is_completed()]
    return max(runs, key=lambda r: r.created)


def test_prefect_deployment_run_watch_completes_and_fails(platform):
    ok = platform.run(
        sys.executable, "-m", "prefect", "deployment", "run", "gpu-pipeline/command-local",
        "--watch", "--watch-timeout", "240",
    )  # fmt: skip
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    run = latest_run(platform, "command-local")
    assert run.state.is_completed()
    from tests.e2e.helpers import artifacts_of

    with platform.settings():
        artifacts = artifacts_of(run.id)
    assert {"gpuflow-preflight", "gpuflow-metrics", "gpuflow-summary"} <= set(artifacts)
    assert "command: completed" in artifacts["gpuflow-summary"].data
    failing = json.dumps({"name": "failing", "job": {"kind": "command", "command": ["false"]}})
    bad = platform.run(
        sys.executable, "-m", "prefect", "deployment", "run", "gpu-pipeline/command-local",
        "--param", f"spec={failing}", "--watch", "--watch-timeout", "240",
    )  # fmt: skip
    assert bad.returncode != 0


def test_prefects_cli_and_a_users_script_find_the_platform_through_its_profile(platform):
    """`platform up` writes the Prefect profile `gpuflow` (URL and auth string, 0600) and
    says how to use it, leaving the active profile alone: with PREFECT_PROFILE=gpuflow and
    nothing exported, `prefect deployment ls` lists the platform's deployments and a job
    started from a script outside any flow is recorded there, with its page in the UI."""
    import tomllib

    profiles = platform.prefect_home / "profiles.toml"
    assert profiles.stat().st_mode & 0o777 == 0o600
    written = tomllib.loads(profiles.read_text())
    assert written.get("active") != "gpuflow"  # never made active behind the user's back
    assert written["profiles"]["gpuflow"]["PREFECT_API_URL"] == platform.api
    assert written["profiles"]["gpuflow"]["PREFECT_API_AUTH_STRING"] == platform.auth
    said = "with the profile gpuflow (`prefect profile use gpuflow`, or PREFECT_PROFILE=gpuflow"
    assert said in platform.up_output
    env = {k: v for k, v in platform.env.items() if k not in ("PREFECT_API_URL", "PREFECT_UI_URL")}
    env["PREFECT_PROFILE"] = "gpuflow"
    listed = subprocess.run(
        [sys.executable, "-m", "prefect", "deployment", "ls"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-2000:]
    assert "gpu-pipeline/command-local" in listed.stdout.replace("\n", "")
    script = (
        "from gpuflow import gpu_job\n"
        "run = gpu_job({'name': 'from-a-script', 'job': {'kind': 'command', 'command': ['true']}})\n"
        "print('RUN', run.flow_run_id, run.url)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [(_, run_id, url)] = [
        line.split() for line in done.stdout.splitlines() if line.startswith("RUN ")
    ]
    assert url == f"{platform.ui}/runs/flow-run/{run_id}"
    with platform.client() as client:
        assert client.read_flow_run(UUID(run_id)).state.is_completed()


def test_submit_tells_each_outcome_apart(platform):
    """... the completed case is docs/ci-example.yml's submit step, run as written with the
    platform's URL and auth string where its secrets go: the deployment it names exists
    after a plain `platform up`."""
    import shlex

    import yaml

    example = yaml.safe_load((ROOT / "docs" / "ci-example.yml").read_text())
    job = example["jobs"]["run-on-gpus"]
    assert job["env"]["PREFECT_API_AUTH_STRING"] == "${{ secrets.GPUFLOW_API_AUTH_STRING }}"
    [step] = [s["run"] for s in job["steps"] if "gpuflow submit" in s.get("run", "")]
    argv = shlex.split(step)
    assert argv[:2] == ["gpuflow", "submit"]
    ok = platform.gpuflow(*argv[1:])  # PREFECT_API_URL and the auth string, as CI sets them
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "completed:" in ok.stdout and f"{platform.ui}/runs/flow-run/" in ok.stdout
    # a job run by the platform's worker looks for the platform's auth string: not there
    snoop = ["sh", "-c", 'env > "$GPUFLOW_OUTPUT_DIR/env.txt"; exit 1']
    failing = json.dumps({"name": "failing", "job": {"kind": "command", "command": snoop}})
    failed = platform.gpuflow(
        "submit", "gpu-pipeline/command-local", "--param", f"spec={failing}", "--wait"
    )
    assert failed.returncode == 1 and "failed" in failed.stderr
    assert "the job exited with code 1" in failed.stderr
    [seen] = (platform.home / "runs").glob("failing-*/outputs/env.txt")
    assert "PATH=" in seen.read_text() and platform.auth not in seen.read_text()
    assert "PREFECT_API_AUTH_STRING" not in seen.read_text()
    missing = platform.gpuflow("submit", "gpu-pipeline/no-such-deployment")
    assert missing.returncode == 2
    assert "deployment 'gpu-pipeline/no-such-deployment' does not exist" in missing.stderr
    unknown = platform.gpuflow("submit", "gpu-pipeline/command-local", "--param", "spek={}")
    assert unknown.returncode == 2 and "'spek' is not a parameter" in unknown.stderr
    invalid = json.dumps({"job": {"kind": "hpc", "ranks": 0, "md": {}}})
    refused = platform.gpuflow("submit", "hpc/hpc-local", "--param", f"spec={invalid}")
    assert refused.returncode == 2 and "job.ranks must be at least 1" in refused.stderr
    sleepy = json.dumps({"name": "sleepy", "job": {"kind": "command", "command": ["sleep", "20"]}})
    timed = platform.gpuflow(
        "submit", "gpu-pipeline/command-local", "--param", f"spec={sleepy}",
        "--wait", "--timeout", "2",
    )  # fmt: skip
    assert timed.returncode == 3, timed.stdout + timed.stderr
    assert "timed out after 2 s; the run is still" in timed.stderr
    assert f"{platform.ui}/runs/flow-run/" in timed.stderr


@pytest.mark.skipif(shutil.which("blender") is None, reason="blender is not installed")
def test_a_scene_uploaded_event_starts_a_render(platform, tmp_path):
    from gpuflow.tasks.render.scene import demo_scene

    scene = demo_scene(shutil.which("blender"), tmp_path / "shot.blend", 2, 32)
    out = tmp_path / "frames"
    before = {r.id for r in _render_runs(platform)}
    payload = {"scene": str(scene), "output": f"file://{out}", "frames": "1-2"}
    # from another process, as an upload script would: this process's events client is
    # bound to the session's test server
    emit = (
        "import json, sys\n"
        "from prefect.events import emit_event\n"
        "emit_event(event='gpuflow.scene.uploaded',"
        " resource={'prefect.resource.id': 'gpuflow.scene.shot'},"
        " payload=json.loads(sys.argv[1]))\n"
    )
    sent = platform.run(sys.executable, "-c", emit, json.dumps(payload), timeout=120)
    assert sent.returncode == 0, sent.stderr[-2000:]
    deadline = time.monotonic() + 240
    run = None
    while time.monotonic() < deadline:
        new = [r for r in _render_runs(platform) if r.id not in before]
        if new and new[0].state.is_final():
            run = new[0]
            break
        time.sleep(1)
    assert run is not None, "no render run finished after the event"
    assert run.state.is_completed(), run.state.message
    assert run.parameters["spec"]["job"]["scene"] == str(scene)  # templated from the event
    assert sorted(p.name for p in out.iterdir()) == ["frame_0001.png", "frame_0002.png"]


def _render_runs(platform):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with platform.client() as client:
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["render-local"])),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=10,
        )


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="no chromium")
def test_the_ui_shows_the_run_and_its_artifacts(platform, tmp_path):
    assert CHROMIUM is not None, "chromium is not installed; the test command installs it"
    run = latest_run(platform, "command-local", completed=True)
    page = f"{platform.ui}/runs/flow-run/{run.id}"
    # without the auth string the UI shows its login, and nothing of the run
    locked = ui_page(page, None, wait_for=(run.name,), timeout_s=15)
    assert run.name not in locked
    shot = Path(os.environ.get("GPUFLOW_SCREENSHOTS", tmp_path)) / "flow-run.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    shown = (run.name, "gpu-pipeline", "command-local", "Completed")
    dom = ui_page(page, platform.auth, wait_for=shown, screenshot=shot)
    assert run.name in dom and "gpu-pipeline" in dom and "command-local" in dom
    assert "Completed" in dom
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
    )

    with platform.client() as client:
        [summary] = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["gpuflow-summary"])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(run.id))])),
        )
    artifact = f"{platform.ui}/artifacts/artifact/{summary.id}"
    artifact_dom = ui_page(artifact, platform.auth, wait_for=("duration:", "cost: $"))
    assert "duration:" in artifact_dom and "cost: $" in artifact_dom


def test_the_run_summary_shows_its_pictures_in_the_ui(platform, tmp_path):
    """The utilisation plot is drawn on the summary's page (its pixels, not its path): an
    <img> whose picture the artifact itself carries, loaded, with its own size."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
    )

    job = tmp_path / "sampled.yaml"
    job.write_text(
        "name: sampled\njob: {kind: command, command: [sleep, '2']}\nmetrics: {interval_s: 0.1}\n"
    )
    ran = platform.gpuflow("run", str(job))
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    [run_id] = [line.rsplit("/", 1)[1] for line in ran.stdout.splitlines() if "flow run: " in line]
    with platform.client() as client:
        [summary] = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["gpuflow-summary"])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(run_id)])),
        )
    assert "![utilisation plot](data:image/png;base64," in summary.data
    artifact = f"{platform.ui}/artifacts/artifact/{summary.id}"
    drawn = (
        "[...document.querySelectorAll('img')].filter(i => i.src.startsWith('data:image/png')"
        " && i.complete && i.naturalWidth > 100 && i.naturalHeight > 50).map(i => i.alt)"
        ".join(',')"
    )
    shot = Path(os.environ.get("GPUFLOW_SCREENSHOTS", tmp_path)) / "summary.png"
    artifact_dom, pictures = ui_page(
        artifact, platform.auth, wait_for=("duration:", "cost: $"), probe=drawn, screenshot=shot
    )
    assert "duration:" in artifact_dom and "cost: $" in artifact_dom
    assert pictures == "utilisation plot", artifact_dom[-3000:]


def test_gpuflow_deploy_deploys_a_users_own_prefect_yaml(platform):
    """From a user's project folder (its own flows/, tasks/, blocks.py and prefect.yaml),
    `gpuflow deploy` checks and deploys its flows onto gpuflow's pool; an entrypoint that
    is not there is one sentence, and nothing is deployed."""
    project = ROOT / "tests" / "e2e" / "project"
    env = {**platform.env, "PREFECT_API_AUTH_STRING": platform.auth}

    def deploy(folder: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "gpuflow", "deploy", "--pool", "gpuflow-local"],
            cwd=folder, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    done = deploy(project)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "deployed 1: nightly" in done.stdout
    with platform.client() as client:
        found = client.read_deployment_by_name("nightly/nightly")
    assert found.entrypoint == "flows/nightly.py:nightly"
    assert str(project) in json.dumps(found.pull_steps)  # the worker runs it from there
    broken = project.parent / "project-broken"
    shutil.copytree(project, broken, ignore=shutil.ignore_patterns("__pycache__"))
    try:
        text = (broken / "prefect.yaml").read_text()
        (broken / "prefect.yaml").write_text(text.replace("flows/nightly.py", "flows/nigthly.py"))
        refused = deploy(broken)
    finally:
        shutil.rmtree(broken)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert refused.stderr.strip() == (
        "gpuflow: invalid input: deployments[nightly].entrypoint: 'flows/nigthly.py:nightly'"
        f" names {broken}/flows/nigthly.py, which is not a file; fix the path (it is read from"
        " the project folder)."
    )


def test_gpuflow_run_records_its_run_on_the_running_platform(platform, tmp_path):
    status = platform.gpuflow("platform", "status")
    assert status.returncode == 0 and f"running: UI {platform.ui}" in status.stdout
    job = tmp_path / "job.yaml"
    job.write_text("name: on-platform\njob: {kind: command, command: [echo, hi]}\n")
    out = platform.as_user("run", str(job))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"[gpuflow] using the local platform (UI {platform.ui})" in out.stderr
    assert "temporary" not in out.stderr
    link = out.stdout.split("flow run: ")[1].split()[0]
    assert link.startswith(f"{platform.ui}/runs/flow-run/")
    with platform.client() as client:
        run = client.read_flow_run(UUID(link.rsplit("/", 1)[1]))
    assert run.state.is_completed() and run.parameters["spec"]["name"] == "on-platform"
    listed = platform.as_user("ls")
    assert listed.returncode == 0, listed.stderr[-3000:]
    [row] = [line.split() for line in listed.stdout.splitlines() if str(run.id)[:8] in line]
    assert row[1:6] == ["on-platform", "Completed", "local", socket.gethostname(), "0"]
    logs = platform.as_user("logs", "on-platform")
    assert logs.returncode == 0 and "hi" in logs.stdout.split(), logs.stderr[-3000:]


def test_up_on_a_port_another_server_holds_is_refused(platform, tmp_path):
    """A second platform (another GPUFLOW_HOME) asked for the running one's port says the
    port is taken and registers nothing there; a port that is no port is refused at once."""
    other = Platform(tmp_path / "other-home", platform.port)
    taken = other.gpuflow("platform", "up", "--port", str(platform.port), timeout=120)
    assert taken.returncode == 1, taken.stdout + taken.stderr
    (line,) = [line for line in taken.stderr.splitlines() if line.startswith("gpuflow:")]
    assert f"port {platform.port} on 127.0.0.1 is taken" in line
    assert "Traceback" not in taken.stderr
    assert not (other.home / "platform" / "state.json").exists()
    status = platform.gpuflow("platform", "status")
    assert status.returncode == 0 and "running: UI" in status.stdout
    for port in ("99999", "0"):
        bad = other.gpuflow("platform", "up", "--port", port, timeout=60)
        assert bad.returncode == 2, bad.stderr
        assert f"argument --port: {port} is out of range; give from 1 to 65535" in bad.stderr


def test_a_server_slower_than_its_start_bound_is_one_sentence_and_leaves_nothing(tmp_path):
    """The server has not answered within GPUFLOW_API_START_TIMEOUT_S (1 s: no cold start is
    that quick): `up` says so in one sentence naming the setting, and stops what it started."""
    slow = Platform(tmp_path / "home", free_port())
    slow.env["GPUFLOW_API_START_TIMEOUT_S"] = "1"
    up = slow.gpuflow("platform", "up", "--port", str(slow.port), timeout=120)
    assert up.returncode == 1, up.stdout + up.stderr
    (line,) = [line for line in up.stderr.splitlines() if line.startswith("gpuflow:")]
    assert f"did not answer {slow.api}/health within 1 s" in line, line
    assert "set GPUFLOW_API_START_TIMEOUT_S higher" in line, line
    assert "Traceback" not in up.stderr
    assert not (slow.home / "platform" / "state.json").exists()
    auth_file = str(slow.home / "platform" / "auth")
    servers = [
        p for p in psutil.process_iter(["cmdline"]) if auth_file in (p.info["cmdline"] or [])
    ]
    assert not [p for p in servers if not process_gone(p.pid)], "the server was left running"


def wait_for_gone(pid: int) -> None:
    deadline = time.monotonic() + 60
    while not process_gone(pid):
        assert time.monotonic() < deadline, f"pid {pid} outlived SIGKILL"
        time.sleep(0.05)


def test_a_platform_whose_up_was_killed_before_its_worker_is_never_called_running(tmp_path):
    """SIGKILL to `platform up` once its server answers, before its worker starts (the
    moment it says so): `status` says it is half started and fails; the next `up` stops
    what was left and starts the whole platform; nothing stays after `down`."""
    half = Platform(tmp_path / "home", free_port())
    killed_at_the_server = (
        "import os, signal, sys\n"
        "from gpuflow.tasks.platform import local\n"
        "def say(line):\n"
        "    print(line, flush=True)\n"
        "    if line.startswith('started the Prefect server'):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        f"local.up(port={half.port}, say=say)\n"
    )
    killed = half.run(sys.executable, "-c", killed_at_the_server, timeout=300)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert set(half.state()["processes"]) == {"server"}
    status = half.gpuflow("platform", "status", timeout=60)
    assert status.returncode == 1, status.stdout
    assert "not healthy: half started: its `gpuflow platform up` (pid" in status.stdout
    assert "ended before its worker started" in status.stdout, status.stdout
    server = half.state()["processes"]["server"]["pid"]
    up = half.gpuflow("platform", "up", "--port", str(half.port), timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "the platform was half started: its `gpuflow platform up` (pid" in up.stdout
    assert "started a process worker" in up.stdout and process_gone(server)
    assert half.gpuflow("platform", "status", timeout=60).returncode == 0
    pids = [p["pid"] for p in half.state()["processes"].values()]
    # its server dies: its worker still polls the port with the auth string, and holds it,
    # so another local user cannot take the port to receive those polls
    os.kill(half.state()["processes"]["server"]["pid"], signal.SIGKILL)
    wait_for_gone(half.state()["processes"]["server"]["pid"])
    assert squatted(half.port) == []
    half.gpuflow("platform", "down", timeout=120)
    assert all(process_gone(pid) for pid in pids)


def test_up_on_another_database_than_the_running_platform_is_refused(platform):
    """The running platform keeps its runs in SQLite: asking for PostgreSQL says so and
    changes nothing (its runs would not be where the user looks)."""
    processes = platform.state()["processes"]
    other = platform.gpuflow(
        "platform", "up", "--port", str(platform.port), "--database", "postgresql", timeout=120
    )
    assert other.returncode == 1, other.stdout + other.stderr
    (line,) = [line for line in other.stderr.splitlines() if line.startswith("gpuflow:")]
    assert "the platform already runs on sqlite; run `gpuflow platform down`" in line, line
    assert platform.state()["processes"] == processes
    assert "postgres" not in processes


def test_secrets_and_flows_say_which_api_they_land_on_and_up_use_makes_it_the_default(
    platform,
):
    """With the platform up: `gpuflow secret set` saves where gpuflow reads secret_env (the
    platform), the value from stdin and never shown; an API named elsewhere (the
    environment, a user's flow on Prefect's ephemeral API) is said in one sentence with the
    fix; `platform up --use` makes the platform's profile the active one. Bad names and
    values are one sentence and save nothing."""
    import tomllib

    env = {k: v for k, v in platform.env.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(platform.prefect_home)  # its profiles: gpuflow's, not active

    def gpuflow(*argv: str, stdin: str = "", **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "gpuflow", *argv], env={**env, **extra}, input=stdin,
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    value = "lab-secret-value-0451"
    saved = gpuflow("secret", "set", "lab-key", stdin=value + "\n")
    assert saved.returncode == 0, saved.stderr[-2000:]
    assert saved.stdout.strip() == (
        f"saved the Secret block lab-key on the local platform (UI {platform.ui}); a spec reads"
        " it as secret_env: {VARIABLE: lab-key}"
    )
    assert value not in saved.stdout + saved.stderr
    bad = {
        ("Lab_Key", value): "NAME: 'Lab_Key' is not a name Prefect takes for a block; use"
        " lowercase letters, digits and dashes (for example lab-key)",
        ("empty-key", "\n"): "the value is empty; give it on standard input, for example"
        " `gpuflow secret set empty-key < key.txt`",
        ("short-key", "abc"): "the value is shorter than 4 characters, too short to mask",
    }
    for (name, given), said in bad.items():
        refused = gpuflow("secret", "set", name, stdin=given)
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
    from prefect.blocks.system import Secret

    with platform.settings():
        assert Secret.load("lab-key").get() == value
        for name in ("empty-key", "short-key"):
            with pytest.raises(ValueError):
                Secret.load(name)
    # an API the platform is not, as gpuflow sees it (the platform's server by another name
    # stands for one here: no second server to start)
    other = f"http://localhost:{platform.port}/api"
    elsewhere_env = {"PREFECT_API_URL": other, "PREFECT_API_AUTH_STRING": platform.auth}
    elsewhere = gpuflow("secret", "set", "elsewhere-key", stdin=value, **elsewhere_env)
    assert elsewhere.returncode == 0, elsewhere.stderr[-2000:]
    assert (
        f"the local platform runs (UI {platform.ui}), but the environment's PREFECT_API_URL"
        f" names {other}: what this command makes is recorded there, not in the"
        " platform; unset PREFECT_API_URL to use the platform" in elsewhere.stderr
    )
    flow = (
        "from prefect import flow\nfrom gpuflow import gpu_job\n"
        "@flow\ndef mine():\n    gpu_job({'job': {'kind': 'command', 'command': ['true']}})\n"
        "mine()\n"
    )
    users = subprocess.run(
        [sys.executable, "-c", flow], env={**env, **elsewhere_env},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert users.returncode == 0, users.stderr[-3000:]
    assert (
        f"the local platform runs (UI {platform.ui}), but this flow runs on {other}: its"
        " jobs are recorded there, not in the platform; run the flow with"
        " PREFECT_PROFILE=gpuflow" in users.stderr
    )
    profiles = platform.prefect_home / "profiles.toml"
    before = tomllib.loads(profiles.read_text()).get("active")
    used = gpuflow("platform", "up", "--use")
    try:
        assert used.returncode == 0, used.stderr[-2000:]
        assert f"already running: UI {platform.ui}" in used.stdout
        assert "the profile gpuflow is the active one" in used.stdout
        assert tomllib.loads(profiles.read_text())["active"] == "gpuflow"
        found = gpuflow("secret", "set", "via-profile", stdin=value)  # no PREFECT_API_URL
        assert "the local platform (UI" in found.stdout, found.stderr[-2000:]
    finally:  # the profile the rest of the module expects
        text = profiles.read_text().replace('active = "gpuflow"', f'active = "{before}"')
        profiles.write_text(text if before else text.replace('active = "None"', ""))


def test_down_stops_everything_it_started(platform):
    processes = platform.state()["processes"]
    down = platform.gpuflow("platform", "down", timeout=120)
    assert down.returncode == 0 and "stopped: admitter, worker, server" in down.stdout
    for name in ("admitter", "worker", "server"):
        assert f"stopped the {name} (pid {processes[name]['pid']})" in down.stdout
    for entry in processes.values():
        assert not psutil.pid_exists(entry["pid"]) or (
            psutil.Process(entry["pid"]).status() == psutil.STATUS_ZOMBIE
        )
    assert not (platform.home / "platform" / "state.json").exists()
    # A run the worker still had (the submit test's, left running at its timeout) is reaped.
    assert nothing_left(platform.home), down.stdout
    status = platform.gpuflow("platform", "status")
    assert status.returncode == 1 and "not running" in status.stdout


def test_a_platform_shared_on_purpose_speaks_tls_1_3_and_still_asks_the_auth_string(tmp_path):
    """`up --listen 0.0.0.0`: a certificate is generated for this host (0600), the server
    answers TLS 1.3 only (not TLS 1.2, not plain HTTP), every request still needs the auth
    string, and Prefect's CLI works as a teammate sets it up; gpuflow's own commands trust
    the generated certificate by themselves. Asked only on 127.0.0.1 here."""
    import ssl
    import urllib.error
    import urllib.request

    from gpuflow.tasks.platform.api import auth_headers

    shared = Platform(tmp_path / "shared-home", free_port())
    up = shared.gpuflow(
        "platform", "up", "--port", str(shared.port), "--listen", "0.0.0.0", timeout=300
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "shared over TLS 1.3 on 0.0.0.0" in up.stdout
        # a teammate is told an address that reaches this machine, never their own
        (told,) = re.findall(r"a teammate sets PREFECT_API_URL=https://([^/:\]]+)", up.stdout)
        assert told not in ("localhost", "127.0.0.1") and not told.startswith("127."), up.stdout
        cert = shared.home / "platform" / "tls" / "cert.pem"
        assert (shared.home / "platform" / "tls" / "key.pem").stat().st_mode & 0o777 == 0o600
        api = f"https://127.0.0.1:{shared.port}/api"
        assert shared.state()["api"] == api
        trusted = ssl.create_default_context(cafile=cert)
        with urllib.request.urlopen(f"{api}/health", context=trusted, timeout=30) as answer:
            assert answer.status == 200 and answer.version == 11
        old = ssl.create_default_context(cafile=cert)
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"{api}/health", context=old, timeout=30)
        with pytest.raises(OSError):  # plain HTTP: the connection is closed unanswered
            urllib.request.urlopen(f"http://127.0.0.1:{shared.port}/api/health", timeout=30)
        body = b'{"include_secrets": true}'
        for headers, code in (({}, 401), (auth_headers(shared.auth), 200)):
            request = urllib.request.Request(
                f"{api}/block_documents/filter",
                data=body,
                headers={"Content-Type": "application/json", **headers},
            )
            try:
                with urllib.request.urlopen(request, context=trusted, timeout=30) as answer:
                    assert answer.status == code
            except urllib.error.HTTPError as exc:
                assert exc.code == code
        teammate = {"PREFECT_API_URL": api, "PREFECT_API_SSL_CERT_FILE": str(cert)}
        shared.env.update(teammate)
        listed = shared.run(sys.executable, "-m", "prefect", "deployment", "ls")
        assert listed.returncode == 0 and "command-local" in listed.stdout, listed.stderr[-2000:]
        job = tmp_path / "job.yaml"
        job.write_text("name: over-tls\njob: {kind: command, command: [echo, hi]}\n")
        ran = shared.as_user("run", str(job))
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert "[gpuflow] using the local platform (UI https://" in ran.stderr
    finally:
        shared.gpuflow("platform", "down", timeout=120)


TLS_BAD = {
    "not an address": (["--listen", "nonsense"], "--listen: 'nonsense' is not an IP address"),
    "not this host's": (["--listen", "203.0.113.9"], "--listen: 203.0.113.9 is not an address of"),
    "cert alone": (["--listen", "0.0.0.0", "--tls-cert", "c.pem"], "go together"),
    "no such file": (
        ["--listen", "0.0.0.0", "--tls-cert", "/nope.pem", "--tls-key", "/nope.key"],
        "--tls-cert: /nope.pem is not a file",
    ),
    "not pem": (
        ["--listen", "0.0.0.0", "--tls-cert", "/etc/hostname", "--tls-key", "/etc/hostname"],
        "are not a PEM certificate and its private key",
    ),
}


@pytest.mark.parametrize("case", list(TLS_BAD))
def test_sharing_the_platform_wrongly_is_one_sentence_and_starts_nothing(case, tmp_path):
    extra, said = TLS_BAD[case]
    other = Platform(tmp_path / "home", free_port())
    out = other.gpuflow("platform", "up", "--port", str(other.port), *extra, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("gpuflow:")]
    assert said in line and "Traceback" not in out.stderr
    assert not (tmp_path / "home" / "platform" / "state.json").exists()
