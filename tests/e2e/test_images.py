"""A job in its own image on this machine (image:): pulled from a registry and pinned by
digest, its GPUs, working folder, outputs and secrets inside, the job contract (SIGTERM,
exit 75, resume) in the container, nothing left after cancel or reap, and every bad image
one sentence before anything is made."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import subprocess_env
from tests.e2e.helpers import NOTHING_LEFT, leftovers, process_gone
from tests.e2e.imagebed import PASSWORD, USER, containers_of, run_of

pytestmark = pytest.mark.e2e
GPUFLOW = [sys.executable, "-m", "gpuflow"]
SECRET = "img-secret-5c1e0b"

# The job: where it runs (the image's Python, its GPUs, its user), what it was given (the
# working folder after setup, ${NAME}, a secret), and the contract: a checkpoint in its
# outputs, exit 75 once at step 3, resumed from it with job.resume_args.
TRAIN = """\
import hashlib, json, os, pathlib, sys, time
out = pathlib.Path(os.environ["GPUFLOW_OUTPUT_DIR"])
ckpt = out / "ckpt.txt"
step = int(ckpt.read_text()) if ckpt.exists() else 0
seen = {
    "python": sys.executable, "debian": pathlib.Path("/etc/debian_version").exists(),
    "uid": os.getuid(), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "devices": sorted(p.name for p in pathlib.Path("/dev").glob("nvidia*")),
    "setup": pathlib.Path("setup.txt").read_text().strip(), "args": sys.argv[1:],
    "secret": hashlib.sha256(os.environ["TOKEN"].encode()).hexdigest(),
    "shm": os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize,
}
(out / f"seen-{step}.json").write_text(json.dumps(seen))
while step < 6:
    step += 1
    ckpt.write_text(str(step))
    if step == 3 and not (out / "preempted").exists():
        (out / "preempted").write_text("x")
        sys.exit(75)
print("trained to", step)
"""


def gpuflow(args, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*GPUFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _env(prefect_api, gpuflow_home, bed) -> dict[str, str]:
    return {**subprocess_env(prefect_api, gpuflow_home, fake_gpus=2), **bed.env}


def test_a_job_runs_in_its_image_with_its_gpus_folder_secrets_and_resumes_there(
    tmp_path, prefect_api, gpuflow_home, image_registry
):
    from prefect.blocks.system import Secret

    Secret(value=SECRET).save("img-test-token", overwrite=True)
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(TRAIN)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: in-image\nimage: {image_registry.ref('py')}\nresources: {{gpus: 1, shm: 256Mi}}\n"
        "secret_env: {TOKEN: img-test-token}\n"
        "job:\n  kind: command\n  workdir: code\n  setup: ['echo ready > setup.txt']\n"
        "  command: [python3, train.py, '${GPUFLOW_NODE_RANK}']\n  resume_args: [--resume]\n"
    )
    out = gpuflow(["run", str(job)], _env(prefect_api, gpuflow_home, image_registry))
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-4000:]
    (run,) = (gpuflow_home / "runs").glob("in-image-*")
    first = json.loads((run / "outputs" / "seen-0.json").read_text())
    resumed = json.loads((run / "outputs" / "seen-3.json").read_text())
    assert first["python"] == "/usr/bin/python3" and first["debian"]  # the image's, not ours
    assert first["uid"] == os.geteuid() and first["gpus"] == "0"
    assert first["devices"] == ["nvidia0"] or first["devices"] == ["nvidia1"]
    assert first["setup"] == "ready" and first["args"] == ["0"]
    assert first["shm"] == 256 << 20  # resources.shm
    assert resumed["args"] == ["0", "--resume"]  # exit 75, resumed from its checkpoint
    assert (run / "outputs" / "ckpt.txt").read_text() == "6"
    assert first["secret"] == hashlib.sha256(SECRET.encode()).hexdigest()
    # pinned once, by digest, recorded in the run's summary; the secret nowhere said
    (pinned,) = [line for line in said.splitlines() if line.startswith("[gpuflow] image ")]
    digest = pinned.rsplit("@", 1)[1].split()[0]
    assert json.loads((run / "metrics.json").read_text())["image"].endswith(f"@{digest}")
    assert SECRET not in said
    assert not containers_of(run.name.rsplit("-", 1)[1])
    assert leftovers(gpuflow_home) == NOTHING_LEFT


def _start(tmp_path, env, image, script) -> tuple[subprocess.Popen, Path]:
    marker = tmp_path / "started"
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: long\nimage: {image}\nresources: {{gpus: 1}}\nlimits: {{stop_grace_s: 20}}\n"
        f"job: {{kind: command, command: [sh, -c, '{script}']}}\n"
    )
    env = {**env, "MARK": str(marker)}
    proc = subprocess.Popen(
        [*GPUFLOW, "run", str(job)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, marker


def _wait_for_container(proc: subprocess.Popen, home: Path) -> tuple[str, str]:
    """The run's id and its unit's container, once it runs."""
    deadline = time.monotonic() + 180
    run = run_of(home)
    while not (names := containers_of(run)):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "the job's container never started"
        time.sleep(0.2)
    (name,) = names
    while "running" not in _state(name):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "the job's container never ran"
        time.sleep(0.2)
    return run, name


def _state(name: str) -> str:
    return subprocess.run(
        ["podman", "inspect", "--format", "{{.State.Status}}", name],
        capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip


def test_ctrl_c_gives_the_job_in_its_container_sigterm_and_its_grace(
    tmp_path, prefect_api, gpuflow_home, image_registry
):
    """SIGTERM reaches the job's own process in the container, which saves its state in
    its grace; what it wrote is kept; no container is left; another local user can
    neither see the container nor read its logs."""
    script = (
        'trap "sleep 2; echo saved > $GPUFLOW_OUTPUT_DIR/state; exit 0" TERM;'
        " echo up; while :; do sleep 0.2; done"
    )
    env = _env(prefect_api, gpuflow_home, image_registry)
    proc, _ = _start(tmp_path, env, image_registry.ref("py"), script)
    run, name = _wait_for_container(proc, gpuflow_home)
    other = subprocess.run(
        ["runuser", "-u", "nobody", "--", "podman", "logs", name],
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    assert other.returncode != 0 and "up" not in other.stdout
    listed = subprocess.run(
        ["runuser", "-u", "nobody", "--", "podman", "ps", "--all"],
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    assert name not in listed.stdout
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, out[-4000:]
    (kept,) = (gpuflow_home / "runs").glob("long-*/outputs/state")
    assert kept.read_text() == "saved\n", out[-4000:]
    assert not containers_of(run) and leftovers(gpuflow_home) == NOTHING_LEFT


def test_reap_removes_the_container_of_a_killed_run(
    tmp_path, prefect_api, gpuflow_home, image_registry
):
    env = _env(prefect_api, gpuflow_home, image_registry)
    proc, _ = _start(tmp_path, env, image_registry.ref("py"), "while :; do sleep 0.2; done")
    run, name = _wait_for_container(proc, gpuflow_home)
    proc.kill()  # SIGKILL: no teardown; the container runs on
    proc.wait(timeout=30)
    assert "running" in _state(name)
    out = gpuflow(["reap"], env)
    assert out.returncode == 0 and "1 leftover cluster(s)" in out.stdout, out.stdout[-3000:]
    assert not containers_of(run) and leftovers(gpuflow_home) == NOTHING_LEFT
    assert process_gone(proc.pid)


def test_a_private_image_needs_its_credentials_and_they_stay_secret(
    tmp_path, prefect_api, gpuflow_home, image_registry
):
    from gpuflow.blocks import RegistryCredentials

    env = _env(prefect_api, gpuflow_home, image_registry)
    private = image_registry.ref("py", private=True)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: private\nimage: {{ref: '{private}', pull: always}}\n"
        "job: {kind: command, command: [python3, -c, 'print(\"hello from inside\")']}\n"
    )
    out = gpuflow(["run", str(job)], env)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    (sentence,) = [line for line in out.stderr.splitlines() if line.startswith("gpuflow:")]
    assert "cannot be pulled: the registry refused it without valid credentials" in sentence
    assert "image.credentials" in sentence and "Traceback" not in out.stderr
    assert leftovers(gpuflow_home) == NOTHING_LEFT  # nothing was made

    RegistryCredentials(registry=image_registry.host, username=USER, password=PASSWORD).save(
        "img-test-registry", overwrite=True
    )
    job.write_text(
        f"name: private\nimage: {{ref: '{private}', pull: always, credentials:"
        " img-test-registry}\n"
        "job: {kind: command, command: [python3, -c, 'print(\"hello from inside\")']}\n"
    )
    out = gpuflow(["run", str(job)], env)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-4000:]
    assert "hello from inside" in said and PASSWORD not in said
    for path in gpuflow_home.rglob("*"):  # nor in what the run kept
        if path.is_file():
            assert PASSWORD.encode() not in path.read_bytes(), path
    assert not list(Path("/tmp").glob("gpuflow-registry-*"))  # the login file is gone


BAD_IMAGES = {
    "upper case": ("{registry}/public/PY:1", 2, "its path must be lower case"),
    "a tag and a bad digest": ("{registry}/public/py:1@sha256:abc", 2, "not an image reference"),
    "not there": ("{registry}/public/nope:1", 2, "the registry has no such image"),
    "another machine's": (
        "{registry}/public/py-arm64:1",
        2,
        "is built for arm64, this host is amd64",
    ),
    "no registry there": ("127.0.0.1:1/public/py:1", 2, "the registry could not be reached"),
}


@pytest.mark.parametrize("case", BAD_IMAGES)
def test_a_bad_image_is_one_sentence_before_anything_is_made(
    case, tmp_path, prefect_api, gpuflow_home, image_registry
):
    ref, code, said = BAD_IMAGES[case]
    job = tmp_path / "job.yaml"
    job.write_text(
        f"image: {ref.format(registry=image_registry.host)}\n"
        "job: {kind: command, command: [python3, -c, 'print(1)']}\n"
    )
    out = gpuflow(["run", str(job)], _env(prefect_api, gpuflow_home, image_registry))
    assert out.returncode == code, out.stdout[-3000:] + out.stderr[-3000:]
    sentences = [line for line in out.stderr.splitlines() if line.startswith("gpuflow:")]
    assert len(sentences) == 1 and said in sentences[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert leftovers(gpuflow_home) == NOTHING_LEFT  # no cluster: no container either


def test_an_image_without_a_shell_or_the_program_is_refused_for_what_needs_it(
    tmp_path, prefect_api, gpuflow_home, image_registry
):
    env = _env(prefect_api, gpuflow_home, image_registry)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"image: {image_registry.ref('noshell')}\n"
        "job: {kind: command, command: [/hello], setup: ['echo hi']}\n"
    )
    out = gpuflow(["run", str(job)], env)
    assert out.returncode == 2 and "has no shell (/bin/sh)" in out.stderr, out.stderr[-3000:]
    job.write_text(
        f"image: {image_registry.ref('py')}\njob: {{kind: command, command: [blender, -b]}}\n"
    )
    out = gpuflow(["run", str(job)], env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"job.command: the image {image_registry.ref('py')!r} has no 'blender'" in out.stderr
    job.write_text(f"image: {image_registry.ref('noshell')}\njob: {{kind: matmul, size: 64}}\n")
    out = gpuflow(["run", str(job)], env)  # a kind whose units run gpuflow's own code
    assert out.returncode == 2, out.stderr[-3000:]
    assert "job.kind: the matmul kind's units run gpuflow's own code" in out.stderr
    assert "has none; add Python 3.11 to the image" in out.stderr
    job.write_text(
        f"image: {image_registry.ref('py')}\n"
        "job: {kind: hpc, program: [hostname], mpirun: /opt/mpi/bin/mpirun}\n"
    )
    out = gpuflow(["run", str(job)], env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"job.mpirun: the image {image_registry.ref('py')!r} has no '/opt/mpi/bin/mpirun'" in (
        out.stderr
    )
    assert leftovers(gpuflow_home) == NOTHING_LEFT  # no cluster: no container either


def test_kinds_that_run_gpuflows_code_run_in_an_image_without_gpuflow(
    tmp_path, prefect_api, gpuflow_home, image_registry
):
    """The matmul and hpc kinds' units run gpuflow's own modules (the benchmark; the MPI
    launcher and its rank wrapper) with the image's python3: gpuflow brings its code and
    what it imports into an image that has only the user's stack (numpy, Open MPI)."""
    env = _env(prefect_api, gpuflow_home, image_registry)
    image = image_registry.ref("py-mpi")
    lacks = subprocess.run(
        ["podman", "run", "--rm", "--entrypoint", "python3", image, "-c", "import pydantic"],
        capture_output=True, text=True, timeout=300, env={**os.environ, **image_registry.env},
    )  # fmt: skip
    assert "No module named 'pydantic'" in lacks.stderr  # nor gpuflow: only the user's stack
    job = tmp_path / "job.yaml"
    job.write_text(f"name: mm\nimage: {image}\njob: {{kind: matmul, size: 64, seconds: 0.2}}\n")
    out = gpuflow(["run", str(job)], env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    (run,) = (gpuflow_home / "runs").glob("mm-*")
    result = json.loads((run / "outputs" / "result.json").read_text())
    assert result["device"] == "cpu" and result["tflops"] > 0 and "numpy" in result
    rank = (
        "import os, sys; print(sys.executable, sys.version_info[:2]);"
        " open(os.environ['GPUFLOW_OUTPUT_DIR'] + '/rank-' + os.environ['OMPI_COMM_WORLD_RANK'],"
        " 'w').write(sys.executable)"
    )
    job.write_text(
        f"name: mpi\nimage: {image}\n"
        "job:\n  kind: hpc\n  ranks: 2\n  oversubscribe: true\n"
        "  build: [sh, -c, 'echo built > built.txt']\n"
        f"  program: [python3, -c, {json.dumps(rank)}]\n"
    )
    out = gpuflow(["run", str(job)], env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    (run,) = (gpuflow_home / "runs").glob("mpi-*")
    ranks = sorted(p.name for p in (run / "outputs").glob("rank-*"))
    assert ranks == ["rank-0", "rank-1"]
    assert (run / "outputs" / "rank-0").read_text() == "/usr/bin/python3"  # the image's
    assert not containers_of(run.name.rsplit("-", 1)[1])
    assert leftovers(gpuflow_home) == NOTHING_LEFT


def test_no_engine_on_the_host_names_what_to_install(
    tmp_path, prefect_api, gpuflow_home, image_registry
):
    bare = tmp_path / "bin"
    bare.mkdir()
    for program in ("sh", "true"):  # a PATH with neither podman nor docker
        (bare / program).symlink_to(f"/bin/{program}")
    env = {**_env(prefect_api, gpuflow_home, image_registry), "PATH": str(bare)}
    job = tmp_path / "job.yaml"
    job.write_text(f"image: {image_registry.ref('py')}\njob: {{kind: command, command: [true]}}\n")
    out = gpuflow(["run", str(job)], env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "this host has no container engine to run it; install podman" in out.stderr
    assert leftovers(gpuflow_home) == NOTHING_LEFT


def test_a_fleet_host_runs_the_job_in_the_same_image_pulled_by_its_digest(
    tmp_path, prefect_api, gpuflow_home, image_registry
):
    """The orchestrator asks the registry for the digest (nothing pulled here); the host's
    engine pulls that digest with the run's login (sent on the host program's input) and
    runs the unit in it with the host's claimed GPU, the working folder and its setup; the
    job is preempted (exit 75) and resumed in the container; nothing is left on the host."""
    from tests.e2e.fleet_bed import claims_on, fleet_bed, host_entry, save_fleet
    from tests.e2e.imagebed import registry

    folder = tmp_path / "registry"
    folder.mkdir()
    conf = {"CONTAINERS_CONF": image_registry.env["CONTAINERS_CONF"]}
    # the hosts' engine settings, as a site would set them (the registry's entry is
    # written into that file once the registry listens)
    host_env = {**conf, "CONTAINERS_REGISTRIES_CONF": str(folder / "registries.conf")}
    with fleet_bed(tmp_path / "bed", ["h1:2"], host_env=host_env) as bed:
        bridge = bed["address"]  # the hosts reach this machine here
        with registry(folder, f"{bridge}:0", images=("py-private", "py-mpi")) as near:
            save_fleet(bed, "imgs", [host_entry(bed, "h1")], lease_s=10)
            from gpuflow.blocks import RegistryCredentials

            RegistryCredentials(registry=near.host, username=USER, password=PASSWORD).save(
                "img-fleet-registry", overwrite=True
            )
            code = tmp_path / "code"
            code.mkdir()
            (code / "train.py").write_text(TRAIN)
            from prefect.blocks.system import Secret

            Secret(value=SECRET).save("img-test-token", overwrite=True)
            job = tmp_path / "job.yaml"
            job.write_text(
                f"name: on-host\nimage: {{ref: '{near.ref('py', private=True)}', credentials:"
                " img-fleet-registry}\nresources: {gpus: 1}\n"
                "placement: {backend: fleet, fleet: imgs}\nsecret_env: {TOKEN: img-test-token}\n"
                "job:\n  kind: command\n  workdir: code\n  setup: ['echo ready > setup.txt']\n"
                "  command: [python3, train.py, '${GPUFLOW_NODE_RANK}']\n"
                "  resume_args: [--resume]\n"
            )
            env = {**_env(prefect_api, gpuflow_home, near), **conf}
            applied = gpuflow(["fleet", "apply", "imgs"], env)
            assert applied.returncode == 0, applied.stdout[-3000:] + applied.stderr[-3000:]
            out = gpuflow(["run", str(job)], env)
            said = out.stdout + out.stderr
            assert out.returncode == 0, said[-4000:]
            # gpuflow's own code (the benchmark) in an image without it: the host's library
            job.write_text(
                f"name: mm-host\nimage: {near.ref('py-mpi')}\n"
                "placement: {backend: fleet, fleet: imgs}\n"
                "job: {kind: matmul, size: 64, seconds: 0.2}\n"
            )
            measured = gpuflow(["run", str(job)], env)
            assert measured.returncode == 0, (measured.stdout + measured.stderr)[-4000:]
    (done,) = (gpuflow_home / "runs").glob("mm-host-*")
    result = json.loads((done / "outputs" / "result.json").read_text())
    assert result["device"] == "cpu" and result["tflops"] > 0 and "numpy" in result
    (run,) = (gpuflow_home / "runs").glob("on-host-*")
    first = json.loads((run / "outputs" / "seen-0.json").read_text())
    resumed = json.loads((run / "outputs" / "seen-3.json").read_text())
    assert first["python"] == "/usr/bin/python3" and first["debian"]
    assert first["gpus"] == "0" and first["setup"] == "ready"
    assert resumed["args"] == ["0", "--resume"]
    assert first["secret"] == hashlib.sha256(SECRET.encode()).hexdigest()
    (pinned,) = [line for line in said.splitlines() if line.startswith("[gpuflow] image ")]
    digest = pinned.rsplit("@", 1)[1].split()[0]
    assert json.loads((run / "metrics.json").read_text())["image"].endswith(f"@{digest}")
    assert PASSWORD not in said and SECRET not in said
    assert not containers_of(run.name.rsplit("-", 1)[1]) and claims_on(bed, "h1") == []


RESUMING = """\
import json, os, pathlib, sys
out = pathlib.Path(os.environ["GPUFLOW_OUTPUT_DIR"]); out.mkdir(exist_ok=True)
ckpt = out / "ckpt.txt"
step = int(ckpt.read_text()) if ckpt.exists() else 0
seen = {"python": sys.executable, "debian": pathlib.Path("/etc/debian_version").exists(),
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "attempt": os.environ["GPUFLOW_ATTEMPT"]}
(out / f"seen-{step}.json").write_text(json.dumps(seen))
while step < 6:
    step += 1
    ckpt.write_text(str(step))
    if step == 3 and os.environ["GPUFLOW_ATTEMPT"] == "1":
        sys.exit(75)
print("trained to", step, flush=True)
"""


def test_an_ec2_instance_runs_the_job_in_the_image_its_agent_pulled(
    aws, played, s3_server, image_registry, monkeypatch
):
    """The agent pulls the run's pinned digest with the run's login (from the run's secret,
    never user-data) and runs each unit in it; exit 75 in the container is retried and the
    retry resumes from the checkpoint, in the same digest."""
    from gpuflow.blocks import RegistryCredentials
    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.spec import load_spec
    from tests.e2e.helpers import logs_of
    from tests.e2e.test_ec2 import left_of, spec

    for key, value in image_registry.env.items():  # this machine's engine settings, and
        monkeypatch.setenv(key, value)  # the played instances' (the same machine)
    played.aws_env.update(image_registry.env)
    fakes = str(Path(__file__).parents[1] / "fakes")  # the instance's one L4, to its agent
    played.aws_env.update({"PYTHONPATH": fakes, "FAKE_NVML_GPUS": "1"})
    RegistryCredentials(registry=image_registry.host, username=USER, password=PASSWORD).save(
        "img-ec2-registry", overwrite=True
    )
    private = image_registry.ref("py", private=True)
    raw = spec(["python3", "-c", RESUMING])
    raw["image"] = {"ref": private, "credentials": "img-ec2-registry"}
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    run_id = str(state.state_details.flow_run_id)
    outputs = Path(result.artifacts_dir, "outputs")
    first = json.loads((outputs / "seen-0.json").read_text())
    resumed = json.loads((outputs / "seen-3.json").read_text())
    assert first["python"] == "/usr/bin/python3" and first["debian"] and first["gpus"] == "0"
    assert resumed["attempt"] == "2" and (outputs / "ckpt.txt").read_text() == "6"
    assert result.metrics.image is not None and "@sha256:" in result.metrics.image
    logs = "\n".join(logs_of(run_id))
    assert f"pulling {result.metrics.image}" in logs  # by the agent, by digest
    [instance] = played.instances.values()
    described = aws["ec2"].describe_instance_attribute(InstanceId=instance.id, Attribute="userData")
    for text in (instance.user_data, instance.console(), logs, str(described)):
        assert PASSWORD not in text
    assert not containers_of(run_id)
    assert left_of(aws, s3_server, run_id)["instances"] == []


@pytest.mark.xdist_group("slurm")  # with the Slurm tests: one test cluster
def test_a_slurm_job_step_runs_in_the_image_through_slurms_oci_support(
    slurm, image_registry, tmp_path, prefect_api, gpuflow_home, monkeypatch
):
    """The image is unpacked once per digest beside the workspaces (skopeo, umoci; the
    login in a file gpuflow's user alone reads) and each step runs in it (`srun
    --container`); exit 75 in the container, then the retried step resumes there."""
    from gpuflow.blocks import RegistryCredentials
    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.spec import load_spec

    for key, value in image_registry.env.items():
        monkeypatch.setenv(key, value)
    RegistryCredentials(registry=image_registry.host, username=USER, password=PASSWORD).save(
        "img-slurm-registry", overwrite=True
    )
    root = tmp_path / "workspaces"
    raw = {
        "name": "slurm-image",
        "image": {
            "ref": image_registry.ref("py", private=True),
            "credentials": "img-slurm-registry",
        },
        "job": {"kind": "command", "command": ["python3", "-c", RESUMING]},
        "resources": {"gpus": 1, "gpu_product": "H100"},
        "placement": {"backend": "slurm", "workspace_root": str(root)},
        "limits": {"max_duration": "10m"},
    }
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    outputs = Path(result.artifacts_dir, "outputs")
    first = json.loads((outputs / "seen-0.json").read_text())
    resumed = json.loads((outputs / "seen-3.json").read_text())
    assert first["python"] == "/usr/bin/python3" and first["debian"]
    assert first["gpus"] == "0" and resumed["attempt"] == "2"
    assert (outputs / "ckpt.txt").read_text() == "6"
    bundles = [p for p in (root / ".gpuflow-images").iterdir() if not p.name.startswith("lib-")]
    (bundle,) = bundles  # kept for the next run of the digest
    assert result.metrics.image.split("@sha256:")[1].startswith(bundle.name)
    assert not list(bundle.rglob("auth.json")) and (bundle / "bundle" / "config.json").is_file()
    assert not list((root).glob("gpuflow-*"))  # the run's workspace went at teardown
    # a kind whose step runs gpuflow's own code, in an image without gpuflow: the library
    # beside the bundles, first on the step's path
    raw |= {"name": "slurm-matmul", "image": image_registry.ref("py-mpi")}
    raw |= {"job": {"kind": "matmul", "size": 64, "seconds": 0.2}}
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    outputs = Path(state.result().artifacts_dir, "outputs")
    measured = json.loads((outputs / "result.json").read_text())
    assert measured["device"] == "cpu" and measured["tflops"] > 0 and "numpy" in measured
    (library,) = (root / ".gpuflow-images").glob("lib-*")
    assert (library / "gpuflow" / "tasks" / "kinds" / "matmul_run.py").is_file()


# A job that keeps its checkpoint in S3 (boto3 in its image), saves it on SIGTERM and
# exits 75, and resumes from it wherever it starts next: outside Slurm it runs until it is
# stopped (the test stops it: no race with a fixed length), on Slurm it ends 10 steps on.
IN_S3 = """\
import json, os, signal, sys, time, boto3
s3 = boto3.client("s3")
bucket, key = os.environ["CKPT"][5:].split("/", 1)
try:
    step = int(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
except s3.exceptions.NoSuchKey:
    step = 0
seen = {"python": sys.executable, "from": step, "slurm": "SLURM_JOB_ID" in os.environ}
s3.put_object(Bucket=bucket, Key=f"{key}.seen-{step}", Body=json.dumps(seen).encode())
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
end = step + 10 if seen["slurm"] else None
while end is None or step < end:
    step += 1
    s3.put_object(Bucket=bucket, Key=key, Body=str(step).encode())
    if stop:
        sys.exit(75)
    time.sleep(0.1)
print("done at", step, flush=True)
"""


@pytest.mark.xdist_group("slurm")  # with the Slurm tests: one test cluster
@pytest.mark.timeout(600)
def test_a_pool_run_preempted_on_ec2_spot_resumes_on_slurm_in_the_same_digest(
    aws, played, s3_server, slurm, image_registry, tmp_path, monkeypatch
):
    """One digest for the run: the EC2 agent pulls it, the spot notice's SIGTERM reaches
    the job in its container, which saves its step to S3 and exits 75; the pool moves on
    to Slurm, whose bundle is made of that same digest, and the job resumes there."""
    from gpuflow.tasks.storage import S3Store
    from tests.e2e.helpers import logs_of
    from tests.e2e.test_ec2 import interrupt_when, pipeline_while, spec

    for key, value in image_registry.env.items():
        monkeypatch.setenv(key, value)
    played.aws_env.update(image_registry.env)
    ckpt = s3_server.url("runs/pool-image/step")
    store = S3Store(s3_server.settings())
    raw = spec(["python3", "-c", IN_S3])
    raw["image"] = image_registry.ref("py-boto")
    raw["env"] = {"CKPT": ckpt}
    spot = {**raw["placement"], "market": "spot"}
    root = tmp_path / "workspaces"
    raw["placement"] = [spot, {"backend": "slurm", "workspace_root": str(root)}]
    raw["resources"] = {"gpus": 1, "disk": "8Gi"}

    def saved_some() -> bool:
        return store.exists(ckpt) and int(store.read_bytes(ckpt)) >= 5

    interrupted: list[str] = []
    state, run_id = pipeline_while(raw, interrupt_when(played, saved_some, interrupted))
    result = state.result()
    assert interrupted and result.cluster.backend == "slurm"
    seen = [o.url for o in store.list(s3_server.url("runs/pool-image/")) if ".seen-" in o.url]
    resumed = [json.loads(store.read_bytes(url)) for url in seen if not url.endswith("-0")]
    assert [r["slurm"] for r in resumed] == [True] and resumed[0]["from"] >= 5
    assert int(store.read_bytes(ckpt)) == resumed[0]["from"] + 10  # resumed, then ended
    first = json.loads(store.read_bytes(ckpt + ".seen-0"))
    assert not first["slurm"] and first["python"] == "/usr/bin/python3"
    pinned = result.metrics.image
    assert pinned is not None and "@sha256:" in pinned
    logs = "\n".join(logs_of(run_id))
    assert f"pulling {pinned}" in logs  # the agent, by the run's digest
    (bundle,) = (root / ".gpuflow-images").iterdir()  # Slurm's, of that same digest
    assert pinned.split("@sha256:")[1].startswith(bundle.name)
    assert [(r["backend"], r["ended"]) for r in result.metrics.by_placement] == [
        ("ec2", "preempted"),
        ("slurm", "completed"),
    ]
    assert not containers_of(run_id)


def test_kubernetes_pods_run_the_digest_the_registry_gives_when_this_machine_reaches_it(
    image_registry, monkeypatch
):
    from gpuflow.tasks.backends.registry import get_backend
    from gpuflow.tasks.contract import Needs
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.spec import load_spec

    for key, value in image_registry.env.items():
        monkeypatch.setenv(key, value)
    backend = get_backend("kubernetes", None)
    said: list[str] = []

    def placed(image: object):
        raw = {"image": image, "job": {"kind": "command", "command": ["true"]}}
        return load_spec(raw | {"placement": {"backend": "kubernetes"}})

    pinned = backend.pin_image(placed(image_registry.ref("py")), Needs(), said.append)
    assert pinned.image is not None and pinned.image.digest is not None
    assert pinned.image.pinned == f"{image_registry.host}/public/py@{pinned.image.digest}"
    with pytest.raises(InvalidSpec) as caught:  # a registry that answers: its word stands
        backend.pin_image(placed(f"{image_registry.host}/public/nope:1"), Needs(), said.append)
    assert "the registry has no such image" in str(caught.value)
    with pytest.raises(InvalidSpec) as caught:  # its login is read before the registry asked
        backend.pin_image(placed({"ref": "r.example/x:1", "credentials": "nope"}), Needs(), print)
    assert "image.credentials: there is no RegistryCredentials block named 'nope'" in str(
        caught.value
    )
    away = backend.pin_image(placed("127.0.0.1:1/team/x:1"), Needs(), said.append)
    assert away.image is not None and away.image.digest is None  # the cluster resolves it
    assert "not reachable from here; the pods pull it as written" in said[-1]


def test_preflight_asks_torch_in_the_image_and_names_both_cuda_versions(
    tmp_path, prefect_api, gpuflow_home, image_registry
):
    """The image's torch is built for CUDA 13.0, the host's driver (the fake NVML's)
    supports 12.4: `gpuflow preflight` says so from inside the image, before any run."""
    job = tmp_path / "job.yaml"
    job.write_text(
        f"image: {image_registry.ref('py-cu130')}\nresources: {{gpus: 1}}\n"
        "job: {kind: command, command: [python3, -c, pass], torch: true}\n"
    )
    out = gpuflow(["preflight", str(job)], _env(prefect_api, gpuflow_home, image_registry))
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    (torch,) = [line for line in out.stdout.splitlines() if line.startswith("[fail] torch")]
    assert "2.9.0+cu130" in torch and "13.0" in torch and "12.4" in torch, torch
    assert leftovers(gpuflow_home) == NOTHING_LEFT  # no cluster: no container either


def test_a_render_reads_and_renders_its_scene_with_the_blender_of_its_image(
    tmp_path, prefect_api, gpuflow_home, image_registry
):
    """A render on this machine in an image that has Blender and no gpuflow: the image's
    Blender (`blender-in-image`, which this machine lacks) reads the scene when the run is
    checked, each chunk renders in a container with the scene mounted read-only, and the
    frames land in the output folder; an image without that Blender is one sentence."""
    import shutil as sh

    from gpuflow.tasks.render.scene import demo_scene
    from tests.e2e.imagebed import push_blender

    assert sh.which("blender-in-image") is None
    image = push_blender(image_registry)
    blend = demo_scene(sh.which("blender"), tmp_path / "scene" / "cube.blend", 4, 16, None)
    out_dir = tmp_path / "frames"
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: in-image-render\nimage: {image}\n"
        f"job: {{kind: render, scene: {blend}, output: 'file://{out_dir}', blender: blender-in-image,"
        " chunk: 2, device: CPU}\n"
    )
    env = _env(prefect_api, gpuflow_home, image_registry)
    out = gpuflow(["run", str(job)], env, timeout=900)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-4000:]
    assert sorted(p.name for p in out_dir.iterdir()) == [f"frame_{n:04d}.png" for n in range(1, 5)]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in out_dir.iterdir())
    (run,) = (gpuflow_home / "runs").glob("in-image-render-*")
    assert not containers_of(run.name.rsplit("-", 1)[1]) and not containers_of("inspect")
    assert leftovers(gpuflow_home) == NOTHING_LEFT
    job.write_text(
        f"image: {image_registry.ref('py')}\n"
        f"job: {{kind: render, scene: {blend}, output: 'file://{out_dir}', blender: blender-in-image}}\n"
    )
    out = gpuflow(["run", str(job)], env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"job.blender: the image {image_registry.ref('py')!r} has no 'blender-in-image'" in (
        out.stderr
    )


def test_training_runs_gpuflows_trainer_in_an_image_with_torch_and_no_gpuflow(
    tmp_path, prefect_api, gpuflow_home, image_registry
):
    """The train kind in an image with Python, numpy and torch and no gpuflow (this
    machine's torch mounted in, tests/e2e/imagebed.py with_torch): gpuflow brings its
    launcher and trainer, torchrun's ranks train in the container on its files here (the
    dataset read-only, the output written), and the checkpoint lands in the output."""
    from gpuflow.tasks.storage import FileStore
    from gpuflow.tasks.training.prepare import prepare
    from tests.e2e.imagebed import TORCH_SITE, with_torch

    dataset, output = tmp_path / "data", tmp_path / "out"
    prepare("synthetic:classify?samples=32", f"file://{dataset}", 20_000, FileStore())
    env = {**_env(prefect_api, gpuflow_home, image_registry)}
    env |= with_torch(image_registry, tmp_path / "engine")
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: in-image-train\nimage: {image_registry.ref('py-mpi')}\n"
        f"env: {{PYTHONPATH: {TORCH_SITE}}}\n"
        f"job: {{kind: train, dataset: 'file://{dataset}', output: 'file://{output}',"
        " batch_size: 8, num_workers: 0, cpu_processes: 1, max_steps: 4, shuffle_buffer: 0,"
        " log_every: 1, checkpoint: {every_steps: 2}}\n"
    )
    out = gpuflow(["run", str(job)], env, timeout=900)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-4000:]
    (run,) = (gpuflow_home / "runs").glob("in-image-train-*")
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["image"].split("@")[0].endswith("/py-mpi")
    assert metrics["job"]["steps"] == 4, metrics["job"]
    assert list(output.rglob("*.pt")) or list(output.rglob("manifest.json")), list(
        output.rglob("*")
    )
    assert not containers_of(run.name.rsplit("-", 1)[1])
    assert leftovers(gpuflow_home) == NOTHING_LEFT


def test_a_service_replica_runs_in_its_image_behind_gpuflows_endpoint(
    prefect_api, gpuflow_home, image_registry, monkeypatch
):
    """The service kind in an image: each replica is a container of it listening on its
    $PORT on the host's network, checked ready, reached through the run's endpoint; a
    cancel stops it and removes its container."""
    from tests.conftest import free_port
    from tests.e2e.test_service import ask, serving

    for key, value in image_registry.env.items():
        monkeypatch.setenv(key, value)
    port = free_port()
    raw = {
        "name": "svc-image",
        "image": image_registry.ref("py"),
        "job": {
            "kind": "service",
            "command": ["sh", "-c", "cd /etc && exec python3 -m http.server $PORT"],
            "port": port,
            "ready": {"path": "/debian_version", "period_s": 0.2},
        },
        "limits": {"max_duration": "10m", "stop_grace_s": 5},
    }
    with serving(raw, gpuflow_home) as served:
        status, body = ask(port, "/debian_version")
        assert status == 200 and body.strip()[:2].isdigit()  # the image's Debian
        run = served.run_id
        assert len(containers_of(run)) == 1
    assert not containers_of(run)
