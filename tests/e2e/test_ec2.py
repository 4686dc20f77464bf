"""The EC2 backend end to end, against moto's EC2, S3 and Secrets Manager (server mode on
loopback, credentials checked) and AWS's instance metadata mock: each instance gpuflow
launches is booted here by running its real user-data (tests/e2e/instances.py), which
starts gpuflow's agent as the instance would; the agent pulls the run's units from S3."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import FLEET
from tests.e2e.instances import PlayedInstances

pytestmark = pytest.mark.e2e


def spec(command: list[str], **sections) -> dict:
    job = {
        "name": "ec2-test",
        "job": {"kind": "command", "command": command},
        "resources": {"gpus": 1, "gpu_product": "L4", "disk": "50Gi"},
        "limits": {"max_duration": "10m", "stop_grace_s": 5},
        "placement": {"backend": "ec2", "block": FLEET, "market": "on-demand"},
        "storage": {"aws_credentials": "gpuflow-test-aws"},
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def left_of(aws: dict, s3_server, run_id: str) -> dict[str, list[str]]:
    """Return what EC2, Secrets Manager and S3 still hold of the run."""
    ec2 = aws["ec2"]
    run = [{"Name": "tag:gpuflow.io/flow-run-id", "Values": [run_id]}]
    live = [
        i["InstanceId"]
        for r in ec2.describe_instances(Filters=run)["Reservations"]
        for i in r["Instances"]
        if i["State"]["Name"] != "terminated"
    ]
    secrets = [
        s["Name"] for s in aws["secretsmanager"].list_secrets()["SecretList"] if run_id in s["Name"]
    ]
    listed = aws["s3"].list_objects_v2(Bucket=s3_server.bucket, Prefix=f"control/{run_id}/")
    return {
        "instances": live,
        "volumes": [v["VolumeId"] for v in ec2.describe_volumes(Filters=run)["Volumes"]],
        "security_groups": [
            g["GroupId"] for g in ec2.describe_security_groups(Filters=run)["SecurityGroups"]
        ],
        "secrets": secrets,
        "mailbox": [o["Key"] for o in listed.get("Contents", [])],
    }


HELLO = (
    "import os, pathlib;"
    "print('hello from node', os.environ['GPUFLOW_NODE_RANK'], flush=True);"
    "print('storage key given:', bool(os.environ.get('AWS_SECRET_ACCESS_KEY')));"
    "out = pathlib.Path(os.environ['GPUFLOW_OUTPUT_DIR']); out.mkdir(exist_ok=True);"
    "(out / 'answer.txt').write_text('42')\n"
    # the agent samples this instance and pushes live: the job waits to see it pushed
    "import sys, time, urllib.request\n"
    "deadline = time.time() + 30\n"
    "while time.time() < deadline:\n"
    "    text = urllib.request.urlopen(sys.argv[1] + '/metrics', timeout=5).read().decode()\n"
    "    if any('job=\"ec2-test\"' in l and 'stage=\"run\"' in l for l in text.splitlines()"
    " if l.startswith('gpuflow_host_cpu_percent')):\n"
    "        print('live metrics seen'); sys.exit(0)\n"
    "    time.sleep(0.2)\n"
    "sys.exit(1)\n"
)


def own_wheel_install(endpoint: str) -> str:
    """An install step as the default's, for a played instance: fetch the run's own wheel
    from its s3:// URL (boto3 on moto here, the AWS CLI there), check its SHA-256, install
    it apart (no dependencies: this machine's), and run the agent from it."""
    fetch = (
        "import boto3, os, sys; bucket, _, key = os.environ['GPUFLOW_WHEEL_URL'][5:]"
        f".partition('/'); boto3.client('s3', endpoint_url='{endpoint}')"
        ".download_file(bucket, key, os.environ['GPUFLOW_WHEEL'])"
    )
    return (
        f'GPUFLOW_WHEEL="$PWD/$(basename "$GPUFLOW_WHEEL")" && {sys.executable} -c "{fetch}"'
        ' && echo "$GPUFLOW_WHEEL_SHA256  $GPUFLOW_WHEEL" | sha256sum --check --quiet'
        f' && {sys.executable} -m pip install -q --no-deps --target "$PWD/site" "$GPUFLOW_WHEEL"'
        f' && export PYTHONPATH="$PWD/site" && GPUFLOW_PYTHON={sys.executable}'
        ' && "$GPUFLOW_PYTHON" -c "import gpuflow; print(\'gpuflow from\', gpuflow.__file__)"'
    )


def test_a_fleet_saved_with_the_old_install_by_name_is_refused_before_launch(aws):
    """The default once was `pip install gpuflow` from PyPI: a block saved with it is one
    sentence before anything is made, not code of whoever holds that name."""
    from gpuflow.blocks.ec2_fleet import INSTALL_BY_NAME, Ec2GpuFleet
    from gpuflow.tasks.errors import InvalidSpec
    from gpuflow.tasks.pipeline.checks import check_spec
    from gpuflow.tasks.spec import load_spec

    fleet = Ec2GpuFleet.load(FLEET)
    fleet.install = INSTALL_BY_NAME
    fleet.save("gpuflow-by-name", overwrite=True)
    raw = spec(["true"], placement={"block": "gpuflow-by-name"})

    def instances() -> int:
        found = aws["ec2"].describe_instances()["Reservations"]
        return sum(len(r["Instances"]) for r in found)

    before = instances()
    with pytest.raises(InvalidSpec) as caught:
        check_spec(load_spec(raw))
    assert str(caught.value).startswith(
        "Ec2GpuFleet 'gpuflow-by-name' install: it installs gpuflow by name from PyPI"
    ), str(caught.value)
    assert instances() == before  # nothing launched


def test_one_instance_boots_its_user_data_runs_the_job_and_teardown_leaves_nothing(
    aws, played, s3_server, pushgateway
):
    from prefect.settings import PREFECT_API_KEY, temporary_settings

    from gpuflow.blocks.ec2_fleet import Ec2GpuFleet
    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.spec import load_spec
    from tests.e2e.conftest import FLEET
    from tests.e2e.helpers import logs_of

    fleet = Ec2GpuFleet.load(FLEET)  # the agent from the run's own wheel, checked by hash
    fleet.install = own_wheel_install(s3_server.endpoint)
    fleet.save(FLEET, overwrite=True)

    metrics = {"pushgateway": pushgateway, "interval_s": 0.2, "push_interval_s": 0.2}
    raw = spec([sys.executable, "-c", HELLO, pushgateway], metrics=metrics)
    api_key = "pnu_gpuflowTestAgentKey0123456789abcdef"  # the agents' token, via Secrets Manager
    with temporary_settings({PREFECT_API_KEY: api_key}):
        state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    run_id = str(state.state_details.flow_run_id)
    result = state.result()
    assert result.exit_code == 0
    [instance] = played.instances.values()
    logs = "\n".join(logs_of(run_id))
    assert "hello from node 0" in logs and "storage key given: True" in logs
    assert "live metrics seen" in logs
    assert result.metrics.samples > 0  # taken on the instance by its agent
    assert f"agent on {instance.id}: ready at 127.0.0.1" in logs  # the agent's own log line
    assert f"gpuflow from {instance.folder}/site/gpuflow/__init__.py" in instance.console()
    assert Path(result.artifacts_dir, "outputs", "answer.txt").read_text() == "42"
    # nothing secret went to the instance in clear: user-data, console, the run's log
    described = aws["ec2"].describe_instance_attribute(InstanceId=instance.id, Attribute="userData")
    sent = base64.b64decode(described["UserData"]["Value"]).decode()
    assert sent == instance.user_data and "gpuflow.tasks.backends.ec2.agent" in sent
    for text in (sent, instance.console(), logs):
        assert s3_server.secret not in text and api_key not in text
    assert left_of(aws, s3_server, run_id) == {
        "instances": [],
        "volumes": [],
        "security_groups": [],
        "secrets": [],
        "mailbox": [],
    }


def pipeline_while(raw: dict, meanwhile) -> tuple:
    """Run the pipeline on `raw` while `meanwhile` runs in a thread; return its completed
    state and flow run id."""
    import threading

    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.spec import load_spec

    watcher = threading.Thread(target=meanwhile, daemon=True)
    watcher.start()
    state = gpu_pipeline(load_spec(raw), return_state=True)
    watcher.join(5)
    assert state.is_completed(), state.message
    return state, str(state.state_details.flow_run_id)


def train_on_ec2(dataset: str, output: str, **job) -> dict:
    """A train spec for the test fleet (one L4 instance by default)."""
    from tests.e2e.test_training import train_spec

    raw = train_spec(dataset, output, **job)
    raw["storage"] = {"aws_credentials": "gpuflow-test-aws"}
    raw |= {k: v for k, v in spec([]).items() if k in ("resources", "limits", "placement")}
    return raw


def interrupt_when(played, ready, interrupted: list[str], warning_s: float = 30) -> Any:
    """Return a watch (for pipeline_while) that serves a spot interruption notice to the
    first instance once `ready()` holds, noting its id in `interrupted`."""
    import time

    def reclaim() -> None:
        until = time.monotonic() + 240
        while time.monotonic() < until:
            if ready() and played.instances:
                [first] = played.instances
                interrupted.append(first)
                played.interrupt(first, warning_s=warning_s)
                return
            time.sleep(0.1)

    return reclaim


# The bitwise-resume trainings: 30 steps, preempted once the rank logged step 6 (held
# there until the preemption's SIGTERM reaches it: see helpers.hold_ranks_at)
RESUME_JOB = {"max_steps": 30, "cpu_processes": 1, "log_every": 1, "checkpoint": {"every_steps": 5}}
RESUME_DATASET = ("datasets/cnn-256", "synthetic:classify?samples=256")
_STRAIGHT: dict[str, dict] = {}


def resume_dataset(s3_server) -> str:
    """Return the bitwise-resume trainings' data set in S3, written on first use."""
    from gpuflow.flows.datasets import prepare_dataset

    url = s3_server.url(RESUME_DATASET[0])
    prepare_dataset(RESUME_DATASET[1], url, "40KB", "gpuflow-test-aws")  # writes it once
    return url


def straight_weights(s3_server) -> dict:
    """Return the weights of RESUME_JOB trained straight through on this machine (once per
    test worker and S3 server: every resume test compares against the same run)."""
    from gpuflow.flows.train import train
    from gpuflow.tasks.spec import load_spec
    from gpuflow.tasks.storage import S3Store
    from tests.e2e.test_training import _weights, train_spec

    if s3_server.url("") not in _STRAIGHT:
        output = s3_server.url("runs/straight-30")
        straight = train_spec(resume_dataset(s3_server), output, **RESUME_JOB)
        straight["storage"] = {"aws_credentials": "gpuflow-test-aws"}
        done = train(load_spec(straight), return_state=True)
        assert done.is_completed(), done.message
        store = S3Store(s3_server.settings())
        _STRAIGHT[s3_server.url("")] = _weights(store, done.result().metrics.job["weights"])
    return _STRAIGHT[s3_server.url("")]


def spot_notice_at_step(played, step: int, interrupted: list[str]) -> Any:
    """Return a watch (for pipeline_while) that holds the first instance's training rank
    at `step`, serves that instance a spot interruption notice, and continues the rank
    once the agent's SIGTERM reaches it; the instance's id goes into `interrupted`."""
    from tests.e2e.helpers import hold_ranks_at, release_when_signalled

    def reclaim() -> None:
        [first] = played.wait_for(1, seconds=240)
        held, _ = hold_ranks_at(first.folder, step)
        interrupted.append(first.id)
        played.interrupt(first.id, warning_s=30)
        release_when_signalled(held)

    return reclaim


@pytest.mark.timeout(600)  # two trainings on CPU, and a new instance
def test_a_spot_notice_checkpoints_and_the_run_resumes_on_a_new_instance_exactly(
    aws, played, s3_server, tmp_path
):
    """The metadata mock serves a spot interruption notice during training: the agent sends
    SIGTERM, the job checkpoints to S3 and exits 75, the run stage retries on a new spot
    instance and resumes; the final weights equal those of an uninterrupted run."""

    from gpuflow.tasks.storage import S3Store
    from tests.e2e.helpers import logs_of, task_runs_of
    from tests.e2e.test_training import _weights

    straight = straight_weights(s3_server)
    raw = train_on_ec2(resume_dataset(s3_server), s3_server.url("runs/ec2-spot"), **RESUME_JOB)
    raw["placement"] = {**raw["placement"], "market": "spot-then-on-demand"}
    interrupted: list[str] = []
    state, run_id = pipeline_while(raw, spot_notice_at_step(played, 6, interrupted))
    logs = "\n".join(logs_of(run_id))
    assert interrupted and "spot interruption notice" in logs
    assert "preempted at step" in logs and "resumed from checkpoint step" in logs
    run_task = next(t for t in task_runs_of(run_id) if t.name.startswith("run"))
    assert run_task.run_count == 2  # preempted once, retried on a new instance
    assert len(played.instances) == 2
    markets = {
        i["InstanceId"]: i.get("InstanceLifecycle", "on-demand")
        for r in aws["ec2"].describe_instances(InstanceIds=list(played.instances))["Reservations"]
        for i in r["Instances"]
    }
    assert set(markets.values()) == {"spot"}  # one interruption: still spot (on_demand_after 2)
    resumed = _weights(S3Store(s3_server.settings()), state.result().metrics.job["weights"])
    assert straight.keys() == resumed.keys()
    assert all(torch_equal(straight[k], resumed[k]) for k in straight)
    assert not any(left_of(aws, s3_server, run_id).values())


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_after_two_spot_interruptions_the_run_rents_on_demand(aws, played, s3_server):
    """Two instances in a row get a spot notice as they boot; the third launch is on-demand
    (placement.on_demand_after: 2) and the job completes there."""
    import time

    from tests.e2e.helpers import logs_of

    raw = spec(
        [sys.executable, "-c", "import time; time.sleep(12); print('done')"],
        placement={"market": "spot-then-on-demand", "on_demand_after": 2},
        retry={"run": {"retries": 3, "delay_s": 0.01}},
    )
    struck: list[str] = []

    def reclaim() -> None:
        until = time.monotonic() + 240
        while time.monotonic() < until and len(struck) < 2:
            for instance in list(played.instances):
                if instance not in struck and len(struck) < 2:
                    struck.append(instance)
                    played.interrupt(instance, warning_s=20)
            time.sleep(0.1)

    _, run_id = pipeline_while(raw, reclaim)
    launched = sorted(
        (i["LaunchTime"], i["InstanceId"], i.get("InstanceLifecycle", "on-demand"))
        for r in aws["ec2"].describe_instances(InstanceIds=list(played.instances))["Reservations"]
        for i in r["Instances"]
    )
    assert [market for _, _, market in launched] == ["spot", "spot", "on-demand"]
    assert [iid for _, iid, _ in launched][:2] == struck
    logs = "\n".join(logs_of(run_id))
    assert "2 spot interruption(s) so far (placement.on_demand_after 2): renting on-demand" in logs
    assert "done" in logs
    assert not any(left_of(aws, s3_server, run_id).values())


def test_an_orphaned_instance_terminates_itself_and_reap_removes_the_rest(
    aws, played, s3_server, prefect_api, gpuflow_home, tmp_path
):
    """gpuflow is SIGKILLed while its job runs: the agent sees the heartbeat stop, stops
    the job and terminates its own instance after limits.orphan_after; `gpuflow reap`
    then finds no instance, removes the security group, secret and mailbox the dead run
    left, and marks its flow run Crashed."""
    import json
    import os
    import signal
    import subprocess
    import time

    import yaml

    from tests.conftest import subprocess_env
    from tests.e2e.helpers import ROOT, flow_run, logs_of

    job_code = (
        "import os, pathlib, time; out = pathlib.Path(os.environ['GPUFLOW_OUTPUT_DIR']);"
        " (out / 'ckpt').write_text('step 7'); print('working', flush=True); time.sleep(600)"
    )
    raw = spec([sys.executable, "-c", job_code], limits={"orphan_after": "12s"})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    env = subprocess_env(prefect_api, gpuflow_home)
    env = {k: v for k, v in env.items() if not k.startswith("AWS_")}
    gpuflow = [sys.executable, "-m", "gpuflow"]
    orchestrator = subprocess.Popen(
        [*gpuflow, "run", str(job)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    until, units = time.monotonic() + 120, []
    while not units and time.monotonic() < until and orchestrator.poll() is None:
        listed = aws["s3"].list_objects_v2(Bucket=s3_server.bucket, Prefix="control/")
        units = [o["Key"] for o in listed.get("Contents", []) if "/log/" in o["Key"]]
        time.sleep(0.2)
    assert units, "the job never printed on its instance"
    run_id, instance = units[0].split("/")[1], units[0].split("/")[3]
    os.kill(orchestrator.pid, signal.SIGKILL)
    orchestrator.wait(timeout=30)
    killed_at = time.monotonic()

    def state() -> str:
        described = aws["ec2"].describe_instances(InstanceIds=[instance])
        return described["Reservations"][0]["Instances"][0]["State"]["Name"]

    while state() != "terminated" and time.monotonic() - killed_at < 120:
        time.sleep(0.5)
    assert state() == "terminated"
    assert time.monotonic() - killed_at >= 12  # not before orphan_after
    gone = json.loads(
        aws["s3"]
        .get_object(Bucket=s3_server.bucket, Key=f"control/{run_id}/gone/{instance}")["Body"]
        .read()
    )
    assert "heartbeat has not changed" in gone["why"]
    assert "terminating this instance: the orchestrator's heartbeat" in "\n".join(logs_of(run_id))

    def reap(*options: str) -> subprocess.CompletedProcess:
        command = [*gpuflow, "reap", "--backend", "ec2", "--block", FLEET, *options]
        return subprocess.run(
            command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )

    looked = reap("--dry-run")
    assert looked.returncode == 0, looked.stderr
    assert f"would remove what run {run_id} left (security group sg-" in looked.stdout
    assert (
        f"secret gpuflow/{run_id}; its flow run is running, but its gpuflow has been silent"
        in looked.stdout
    )
    assert "would terminate 0 instance(s) of 1 run(s)" in looked.stdout
    assert left_of(aws, s3_server, run_id)["secrets"]  # a dry run removes nothing
    reaped = reap()
    assert reaped.returncode == 0, reaped.stderr
    assert not any(left_of(aws, s3_server, run_id).values())
    assert flow_run(run_id).state.type.value == "CRASHED"
    # what the job wrote came from the mailbox (its agent sent it when it stopped the job)
    # into the run's artifacts before the mailbox went
    assert "the job's outputs were kept: 1 file(s) in" in reaped.stdout, reaped.stdout
    (kept,) = (gpuflow_home / "runs").glob("*/outputs/ckpt")
    assert kept.read_text() == "step 7"
    from gpuflow.flows.reap import reap as reap_flow  # the scheduled deployment's flow

    state = reap_flow(backend="ec2", block=FLEET, dry_run=True, return_state=True)
    assert state.is_completed(), state.message
    assert state.result()["runs"] == 0 and state.result()["instances"] == 0
    from tests.e2e.helpers import artifacts_of

    assert "reap ec2 (dry run)" in str(
        artifacts_of(state.state_details.flow_run_id)["gpuflow-reap-ec2"].data
    )


def test_two_instances_train_one_job_and_teardown_leaves_nothing(aws, played, s3_server):
    """resources.nodes: 2 launches two instances in one security group that lets only the
    run's nodes in; one torchrun per instance meets at node 0's address (two ranks)."""
    from gpuflow.flows.datasets import prepare_dataset
    from gpuflow.flows.train import train
    from gpuflow.tasks.contract import run_port
    from gpuflow.tasks.spec import load_spec

    dataset = s3_server.url("datasets/ec2-two")
    prepare_dataset("synthetic:classify?samples=128", dataset, "40KB", "gpuflow-test-aws")
    raw = train_on_ec2(dataset, s3_server.url("runs/ec2-two"), max_steps=10, cpu_processes=1)
    raw["resources"] = {**raw["resources"], "nodes": 2}
    state = train(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.metrics.job["world_size"] == 2 and result.metrics.job["steps"] == 10
    assert len(played.instances) == 2
    run_id = result.flow_run_id
    # node 0's address, on a port of the run's own (two runs' nodes may share an address)
    assert result.cluster.rendezvous == f"{result.cluster.hostname}:{run_port(str(run_id))}"
    groups = {
        g["GroupId"]
        for r in aws["ec2"].describe_instances(InstanceIds=list(played.instances))["Reservations"]
        for i in r["Instances"]
        for g in i["SecurityGroups"]
    }
    assert len(groups) == 1  # both nodes in the run's own group
    assert not any(left_of(aws, s3_server, run_id).values())


@pytest.mark.parametrize(
    ("fleet", "job", "expected"),
    [
        (
            {"image_id": None},
            {},
            "Ec2GpuFleet 'gpuflow-test-bad' image_id: no machine image is set; set it to an AMI"
            " with NVIDIA's driver and Python 3.11+ in the fleet's region.",
        ),
        (
            {"control_prefix": "/tmp/control"},
            {},
            "Ec2GpuFleet 'gpuflow-test-bad' control_prefix: /tmp/control is not an s3:// prefix;"
            " set it to a bucket and prefix the instances can read and write.",
        ),
        (
            {"control_prefix": "s3://no-such-bucket/control"},
            {},
            "reach the control bucket no-such-bucket",
        ),
        (
            {"region": "mars-1"},
            {},
            "Ec2GpuFleet 'gpuflow-test-bad' region: 'mars-1' is not an AWS region; use one such"
            " as us-east-1, us-west-2 or eu-west-1.",
        ),
        (
            {},
            {"resources": {"gpus": 1, "gpu_product": "A100-80GB"}},
            "resources.gpu_product: no EC2 instance type in us-east-1 (families g6) has"
            " NVIDIA-A100-SXM4-80GB; types there have NVIDIA-L4; pick one of those.",
        ),
        (
            {},
            {"limits": {"max_cost_usd": 0.01}},
            "limits.max_cost_usd: $0.01 buys less than one hour of the cheapest fitting offer",
        ),
        (
            {},
            {"job": {"kind": "render", "scene": "file:///tmp/a.blend", "output": "file:///tmp/f"}},
            "job.scene: file:///tmp/a.blend is on this machine, and on ec2 the job runs on"
            " rented instances that cannot read it; upload it and give an s3:// URL.",
        ),
    ],
)
def test_bad_input_is_one_sentence_and_nothing_is_launched(
    aws, s3_server, tmp_path, capsys, fleet, job, expected
):
    import yaml

    from gpuflow.blocks.ec2_fleet import Ec2GpuFleet
    from gpuflow.cli import main

    settings = Ec2GpuFleet.load(FLEET).model_dump(exclude={"block_type_slug"}) | fleet
    Ec2GpuFleet(**settings).save("gpuflow-test-bad", overwrite=True)
    raw = spec(["true"], placement={"block": "gpuflow-test-bad"})
    for name, values in job.items():
        raw[name] = values if name == "job" else {**raw[name], **values}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    before = left_count(aws)
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    [said] = [line for line in err.splitlines() if line.startswith("gpuflow: ")]
    assert said.startswith("gpuflow: invalid input: ") and expected in said, err
    assert "Traceback" not in err
    assert left_count(aws) == before  # nothing launched or made


def left_count(aws: dict) -> tuple[int, int, int]:
    ec2 = aws["ec2"]
    instances = sum(len(r["Instances"]) for r in ec2.describe_instances()["Reservations"])
    groups = len(ec2.describe_security_groups()["SecurityGroups"])
    return instances, groups, len(aws["secretsmanager"].list_secrets()["SecretList"])


def test_render_chunks_run_side_by_side_on_an_instance_that_uploads_its_frames(
    aws, played, s3_server, tmp_path
):
    """8 frames in chunks of 2 on a 4-GPU instance: four units at once on one agent, each
    fetching the scene from S3, running Blender (its CPU: no GPU here) and uploading its
    frames; the run counts them from the units' lines. A rerun renders nothing."""
    import shutil as sh

    from gpuflow.flows.render import render
    from gpuflow.tasks.render.scene import demo_scene
    from gpuflow.tasks.spec import load_spec
    from gpuflow.tasks.storage import store_for

    blender = sh.which("blender")
    assert blender, "blender is not installed; the test command installs it"
    scene = s3_server.url("ec2-scenes/cube.blend")
    store = store_for(scene, s3_server.settings())
    store.upload_file(scene, demo_scene(blender, tmp_path / "cube.blend", 8, 32, None))
    output = s3_server.url("ec2-renders/cube")
    raw = spec([])
    raw["job"] = {"kind": "render", "scene": scene, "output": output, "chunk": 2, "device": "CPU"}
    raw["resources"] = {"gpus": 4, "gpu_product": "L4", "disk": "50Gi"}
    raw["metrics"] = {"plot": False}
    state = render(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    [instance] = played.instances.values()
    assert sorted(o.url for o in store.list(output)) == [
        f"{output}/frame_{i:04d}.png" for i in range(1, 9)
    ]
    job = state.result().metrics.job
    assert (job["frames_rendered"], job["frames_missing"], job["chunks"]) == (8, 0, 4)
    [described] = aws["ec2"].describe_instances(InstanceIds=[instance.id])["Reservations"]
    assert described["Instances"][0]["InstanceType"] == "g6.12xlarge"  # 4 L4s, the smallest
    assert not any(left_of(aws, s3_server, str(state.state_details.flow_run_id)).values())
    rerun = render(load_spec(raw), return_state=True)
    assert rerun.is_completed(), rerun.message
    assert rerun.result().metrics.job["frames_skipped"] == 8
    assert len(played.instances) == 1  # every frame was in storage: the rerun rented nothing
    assert rerun.result().preflight == "skipped"
    assert not any(left_of(aws, s3_server, str(rerun.state_details.flow_run_id)).values())


def test_an_agent_whose_job_outlives_max_duration_terminates_its_instance(
    aws, s3_server, mock_binary, tmp_path
):
    """The agent's own deadline (max_duration plus grace), with the orchestrator's heartbeat
    still beating: the running unit is stopped and the instance terminates itself."""
    import json
    import time

    from gpuflow.tasks.backends.ec2.agent import AgentConfig, UnitSpec
    from gpuflow.tasks.backends.ec2.backend import Heartbeat
    from gpuflow.tasks.backends.instances.mailbox import Mailbox, unit_key

    ec2 = aws["ec2"]
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    run_id = "deadline-run"
    tags = [
        {"Key": "gpuflow.io/owner", "Value": "gpuflow"},
        {"Key": "gpuflow.io/flow-run-id", "Value": run_id},
    ]
    config = AgentConfig(
        run_id=run_id,
        control=f"s3://{s3_server.bucket}/control",
        region="us-east-1",
        endpoint_url=s3_server.endpoint,
        secret_id=f"gpuflow/{run_id}",
        orphan_after_s=600,
        deadline_s=8,
    )
    aws["secretsmanager"].create_secret(
        Name=config.secret_id, SecretString=json.dumps({"env": {}}), Tags=tags
    )
    mailbox = Mailbox(aws["s3"], config.control, run_id)
    beat = Heartbeat(mailbox, 1.0)
    played = PlayedInstances(
        ec2,
        mock_binary,
        tmp_path / "instances",
        {
            "AWS_ACCESS_KEY_ID": s3_server.key_id,
            "AWS_SECRET_ACCESS_KEY": s3_server.secret,
            "AWS_DEFAULT_REGION": "us-east-1",
        },
    )
    user_data = (
        "#!/bin/bash\nexec "
        f"{sys.executable} -m gpuflow.tasks.backends.ec2.agent --config {config.encode()}\n"
    )
    try:
        with played:
            [made] = ec2.run_instances(
                ImageId=image,
                InstanceType="g6.xlarge",
                MinCount=1,
                MaxCount=1,
                UserData=user_data,
                TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
            )["Instances"]
            instance = made["InstanceId"]
            until = time.monotonic() + 60
            while mailbox.get(f"nodes/{instance}/ready") is None:
                assert time.monotonic() < until, played.instances[instance].console()
                time.sleep(0.2)
            sleeper = UnitSpec(name="main-1", command=["sleep", "600"], timeout_s=600)
            mailbox.put(unit_key(instance, "main-1", "unit.json"), sleeper.model_dump_json())

            def state() -> str:
                [r] = ec2.describe_instances(InstanceIds=[instance])["Reservations"]
                return r["Instances"][0]["State"]["Name"]

            while state() != "terminated":
                assert time.monotonic() < until, played.instances[instance].console()
                time.sleep(0.3)
            result = json.loads(mailbox.get(unit_key(instance, "main-1", "result.json")))
            assert result["signal"] == 15 and "time is up" in result["stopped"]
            gone = json.loads(mailbox.get(f"gone/{instance}"))
            assert gone["why"] == "the job's time is up (limits.max_duration plus grace, 8 s)"
    finally:
        beat.stop()
        mailbox.delete_all()
        aws["secretsmanager"].delete_secret(
            SecretId=config.secret_id, ForceDeleteWithoutRecovery=True
        )


OWN_CODE = Path(__file__).resolve().parents[1] / "fixtures" / "owncode"


def test_the_readme_example_runs_in_its_working_folder_on_an_instance(aws, played, s3_server):
    """job.workdir on EC2: the archive goes beside the run's mailbox, the instance's
    starter fetches it with the instance's role, checks its hash and starts the command
    in it after the setup; the archive goes with the mailbox at teardown."""
    import shutil

    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.spec import load_spec
    from tests.e2e.helpers import logs_of

    folder = played.root.parent / "project"
    shutil.copytree(OWN_CODE, folder)
    out = "${GPUFLOW_OUTPUT_DIR}/model.json"
    raw = spec(["python", "train.py", "--epochs", "3", "--out", out])
    raw["job"] |= {"workdir": str(folder), "setup": ["echo set up on the instance"]}
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    run_id = str(state.state_details.flow_run_id)
    logs = "\n".join(logs_of(run_id))
    assert "set up on the instance" in logs and "epoch 2 loss 0.8333" in logs
    assert "files here: .gitignore,data,ddp.py,train.py" in logs
    model = Path(state.result().artifacts_dir, "outputs", "model.json")
    assert json.loads(model.read_text())["epochs"] == 3
    assert not any(left_of(aws, s3_server, run_id).values())


def test_torchrun_on_two_instances_all_reduces_checkpoints_and_resumes(aws, played, s3_server):
    """launcher: torchrun on two instances: one torchrun per instance meets at node 0's
    address; the all-reduce over both ranks is 3; SIGTERM -> checkpoint -> 75 -> the
    retried attempt resumes with --resume on the same instances."""
    import shutil

    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.spec import load_spec
    from tests.e2e.helpers import logs_of

    folder = played.root.parent / "project"
    shutil.copytree(OWN_CODE, folder)
    raw = spec(["python", "ddp.py"], env={"PREEMPT_ONCE": "1"})
    raw["job"] |= {
        "workdir": str(folder),
        "launcher": "torchrun",
        "ranks_per_node": 1,
        "resume_args": ["--resume"],
    }
    raw["resources"] = {**raw["resources"], "nodes": 2}
    raw["retry"] = {"run": {"retries": 1, "delay_s": 0}}
    state = gpu_pipeline(load_spec(raw), return_state=True)
    assert state.is_completed(), state.message
    run_id = str(state.state_details.flow_run_id)
    logs = "\n".join(logs_of(run_id))
    for rank in (0, 1):
        assert f"rank {rank}/2 sum 3 resumed False" in logs
        assert f"rank {rank}/2 sum 3 resumed True" in logs
    assert "interrupted and saved its state (exit 75)" in logs
    assert len(played.instances) == 2
    assert not any(left_of(aws, s3_server, run_id).values())
