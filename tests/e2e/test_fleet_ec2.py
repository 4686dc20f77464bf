"""An elastic EC2 fleet on moto: each instance moto launches for the fleet is played as a
host of a fleet test bed at its private address (tests/e2e/fleet_bed.py
PlayedFleetInstances), with its real user-data letting the fleet's key in and publishing
its host key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.pipeline.checks import check_spec
from gpuflow.tasks.spec import load_spec
from tests.conftest import free_port
from tests.e2e.conftest import FLEET
from tests.e2e.fleet_bed import PlayedFleetInstances, fleet_bed
from tests.e2e.helpers import events_named, gpuflow
from tests.e2e.test_fleet import in_thread, wait_for

GPUFLOW = [sys.executable, "-m", "gpuflow"]


def serving_replicas(script: str, bed: dict):
    """Yield the service replicas (running `script`) on the played instances of `bed`."""
    import contextlib

    import psutil

    for proc in psutil.process_iter(["cmdline", "status"]):
        if script in (proc.info["cmdline"] or []) and proc.info["status"] != "zombie":
            with contextlib.suppress(psutil.Error):
                if str(bed["dir"]) in proc.environ().get("GPUFLOW_WORKSPACE", ""):
                    yield proc


def fleet_instances(ec2, states: list[str] | None = None) -> list[dict]:
    filters = [{"Name": "tag:gpuflow.io/fleet", "Values": ["elastic"]}]
    if states:
        filters.append({"Name": "instance-state-name", "Values": states})
    found = []
    for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
        for reservation in page["Reservations"]:
            found += reservation["Instances"]
    return found


@pytest.fixture
def elastic(aws, prefect_api, tmp_path, s3_server):
    """Fleet `elastic`: no listed host; up to 3 g6.xlarge instances (one L4 each) in a
    subnet on the test bed's /24; idle_duration 10 s."""
    from prefect.blocks.system import Secret

    from gpuflow.blocks import GpuFleet
    from gpuflow.tasks.backends.ec2.catalog import gpu_types

    ec2 = aws["ec2"]
    with fleet_bed(tmp_path / "bed", []) as bed:
        net = bed["address"].rsplit(".", 1)[0]
        vpc = ec2.create_vpc(CidrBlock=f"{net}.0/24")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(
            VpcId=vpc, CidrBlock=f"{net}.0/24", AvailabilityZone="us-east-1a"
        )["Subnet"]["SubnetId"]
        Secret(value=bed["key"]).save("fleet-test-key", overwrite=True)
        GpuFleet(
            ssh_key="fleet-test-key",
            lease_s=10,
            ec2={
                "block": FLEET,
                "nodes": {"min": 0, "max": 3},
                "instance_types": ["g6.xlarge"],
                "user": "root",
                "subnet": subnet,
                "idle_duration_s": 10,
                "grow_after_s": 0,
            },
        ).save("elastic", overwrite=True)
        products = {t.instance_type: (t.gpus, t.product) for t in gpu_types(ec2, ["g6"])}
        profile = {"AWS_ACCESS_KEY_ID": s3_server.key_id, "AWS_SECRET_ACCESS_KEY": s3_server.secret}
        with PlayedFleetInstances(ec2, bed, products, profile) as played:
            yield {"bed": bed, "ec2": ec2, "played": played, "s3": aws["s3"], "vpc": vpc}
            # the next test's fleet starts empty: what this one left running is ended
            cli(prefect_api, tmp_path / "home", "fleet", "delete", "elastic")


def latest_artifacts(key: str) -> list:
    """Return the latest artifact of `key` (as one item), its table's rows as `data`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_latest_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    for artifact in found:
        if isinstance(artifact.data, str):
            artifact.data = json.loads(artifact.data)
    return found


def elastic_spec(command: list[str], name: str) -> dict:
    return {
        "name": name,
        "job": {"kind": "command", "command": command},
        "resources": {"gpus": 1},
        "placement": {"backend": "fleet", "fleet": "elastic", "gpu_wait": "2m"},
        "limits": {"max_duration": "10m"},
    }


def cli(prefect_api, gpuflow_home, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "GPUFLOW_HOME": str(gpuflow_home)}
    return subprocess.run([*GPUFLOW, *argv], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.timeout(600)
def test_an_elastic_fleet_grows_for_queued_runs_reuses_warm_instances_and_shrinks_to_zero(
    elastic, prefect_api, gpuflow_home, s3_server, tmp_path, capsys
):
    """min 0, max 3: three runs queued at once (each waits until all three run) grow the
    fleet to three instances, no more; the next run takes a warm one (no launch); past
    idle_duration the scaler ends them all; `fleet delete` leaves nothing in moto."""
    ec2 = elastic["ec2"]
    # more GPUs per node than a new instance has: named before anything is launched
    too_big = load_spec(elastic_spec(["true"], "too-big") | {"resources": {"gpus": 2}})
    with pytest.raises(
        InvalidSpec, match=r"the largest, a new g6.xlarge, has 1\); ask for at most 1"
    ):
        check_spec(too_big)
    assert fleet_instances(ec2) == []
    met = tmp_path / "met"
    met.mkdir()
    wait_all = (
        f'touch {met}/"$(hostname)-$$"; n=0;'
        f' while [ "$(ls {met} | wc -l)" -lt 3 ]; do n=$((n+1));'
        ' [ $n -gt 3000 ] && { echo "only some met"; exit 1; }; sleep 0.1; done; echo met'
    )
    states: list = []

    def one(i: int):
        def body():
            spec = load_spec(elastic_spec(["sh", "-c", wait_all], f"queued-{i}"))
            states.append(gpu_pipeline(spec, return_state=True))

        return body

    threads = [in_thread(one(i)) for i in range(3)]
    for thread in threads:
        thread.join(400)
    played = elastic["played"]
    assert len(states) == 3 and all(s.is_completed() for s in states), (
        [s.message for s in states],
        played.errors,
        played.console,
    )
    launched = fleet_instances(ec2)
    assert len(launched) == 3, [i["InstanceId"] for i in launched]  # what they needed, no more
    hosts = {s.result().cluster.node_names[0] for s in states}
    assert hosts == {i["InstanceId"] for i in launched}  # one run per one-GPU instance
    # the host key came from the instance (through S3), not its user-data; no private key there
    for home in played.booted.values():
        user_data = (home / "user-data").read_text()
        host_key = (home / "host_key.pub").read_text().split()[1]
        assert host_key not in user_data and "PRIVATE KEY" not in user_data
        assert s3_server.secret not in user_data  # the instance's profile, not our keys
    # the next run: a warm instance, no launch
    state = gpu_pipeline(load_spec(elastic_spec(["echo", "warm"], "warm")), return_state=True)
    assert state.is_completed(), state.message
    assert len(fleet_instances(ec2)) == 3
    assert state.result().cluster.node_names[0] in hosts
    # offers: each warm host's free GPUs now, then what growing the fleet would cost
    job = tmp_path / "job.json"
    job.write_text(json.dumps(elastic_spec(["true"], "offered")))
    code, out, err = gpuflow(capsys, "offers", str(job), "--json")
    assert code == 0, out + err
    rows = json.loads(out)
    wheres = [row["where"] for row in rows]
    assert sum(w.startswith("fleet/elastic i-") for w in wheres) == 3, wheres
    grow = next(row for row in rows if "(new)" in row["where"])
    assert grow["where"] == "fleet/elastic +1 x g6.xlarge (new)" and grow["hourly_usd"] > 0
    # status: per instance, what it cost and what of it was idle
    code, out, err = gpuflow(capsys, "fleet", "status", "elastic", "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert sorted(c["instance"] for c in shown["instances"]) == sorted(hosts)
    assert all(c["used_hours"] > 0 and c["idle_cost_usd"] >= 0 for c in shown["instances"])
    # idle past idle_duration (10 s): one scaler period ends them all (min 0)
    time.sleep(10)
    code, out, err = gpuflow(capsys, "fleet", "scale", "elastic")
    assert code == 0, out + err
    assert out.count("shrink") == 3, out
    # its decisions: Prefect events, and the table artifact of the scaler's flow run
    shrank = events_named("gpuflow.fleet.shrank", "gpuflow.fleet.elastic")
    assert len(shrank) == 3 and all("idle for" in e["payload"]["why"] for e in shrank), shrank
    [scaler] = [a for a in latest_artifacts("fleet-elastic-scale")]
    assert sorted(row["instance"] for row in scaler.data if row["action"] == "shrink") == sorted(
        hosts
    ), scaler.data
    wait_for(lambda: not fleet_instances(ec2, ["pending", "running"]), 60, "the instances' end")
    wait_for(lambda: not elastic["played"].booted, 60, "the hosts' power cut")
    code, out, err = gpuflow(capsys, "fleet", "delete", "elastic")
    assert code == 0, out + err
    groups = ec2.describe_security_groups(
        Filters=[{"Name": "tag:gpuflow.io/fleet", "Values": ["elastic"]}]
    )["SecurityGroups"]
    assert groups == []
    volumes = ec2.describe_volumes(
        Filters=[{"Name": "tag:gpuflow.io/fleet", "Values": ["elastic"]}]
    )["Volumes"]
    assert [v for v in volumes if v["State"] != "deleted"] == []
    left = elastic["s3"].list_objects_v2(Bucket=s3_server.bucket, Prefix="control/fleets/")
    assert left.get("KeyCount", 0) == 0, left.get("Contents")


def test_bad_elastic_fleet_input_is_one_sentence(prefect_api, gpuflow_home, tmp_path):
    """min above max, max 0: one sentence naming the field, nothing saved."""
    for nodes, said in (
        ({"min": 3, "max": 2}, "ec2.nodes: min (3) is above max (2); set min to at most 2."),
        ({"min": 0, "max": 0}, "ec2.nodes: max is 0: the fleet could never have an instance"),
    ):
        path = tmp_path / "bad.yaml"
        path.write_text(
            json.dumps(
                {
                    "name": "bad-elastic",
                    "ssh_key": "k",
                    "ec2": {"block": FLEET, "instance_types": ["g6.xlarge"], "nodes": nodes},
                }
            )
        )
        done = cli(prefect_api, gpuflow_home, "fleet", "apply", str(path))
        assert done.returncode != 0
        assert said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    from gpuflow.blocks import GpuFleet

    with pytest.raises(ValueError):
        GpuFleet.load("bad-elastic")


@pytest.mark.timeout(420)
def test_a_spot_reclaim_of_a_fleet_instance_is_a_preemption_and_the_fleet_grows_for_it(
    elastic, tmp_path
):
    """The instance running the unit is reclaimed (moto terminates it; its host's power is
    cut): the unit ends as preempted, the run stage's retry finds no free host, the fleet
    grows by a new instance (the reclaimed one's slot freed), and the unit runs again there."""
    from tests.e2e.helpers import logs_of

    ec2, played = elastic["ec2"], elastic["played"]
    mark = tmp_path / "started"
    once = (
        f'if [ -f {mark} ]; then echo "resumed in $GPUFLOW_WORKSPACE"; exit 0; fi;'
        f" touch {mark}; sleep 300"
    )
    done: dict = {}
    flow = in_thread(
        lambda: done.update(
            state=gpu_pipeline(
                load_spec(elastic_spec(["sh", "-c", once], "reclaimed")), return_state=True
            )
        )
    )
    wait_for(mark.exists, 180, "the unit's start")
    (first,) = [i["InstanceId"] for i in fleet_instances(ec2, ["running"])]
    ec2.terminate_instances(InstanceIds=[first])  # EC2 takes the spot instance back
    flow.join(timeout=360)
    assert not flow.is_alive(), "the run did not end"
    state = done["state"]
    assert state.is_completed(), (state.message, played.errors)
    logs = "\n".join(logs_of(state.state_details.flow_run_id))
    assert f"fleet host {first}" in logs, logs  # named as the host that was lost
    (second,) = [i["InstanceId"] for i in fleet_instances(ec2, ["running"])]
    assert second != first
    assert f"resumed in {elastic['bed']['dir']}/{second}/" in logs, logs  # on the new one


def test_an_elastic_fleet_whose_aws_does_not_answer_is_named_in_one_sentence(
    prefect_api, gpuflow_home, tmp_path, s3_server
):
    """apply asks EC2 which instance types it offers: an endpoint nobody listens on is
    named with its real cause, no traceback, and nothing is saved."""
    from prefect.blocks.system import Secret

    from gpuflow.blocks import Ec2GpuFleet, GpuFleet
    from tests.conftest import free_port, save_aws_block

    class Away:  # the test S3 server's credentials, at a port nothing listens on
        endpoint = f"http://127.0.0.1:{free_port()}"
        key_id, secret = s3_server.key_id, s3_server.secret

    Ec2GpuFleet(
        aws_credentials=save_aws_block(Away, "away-aws"),
        image_id="ami-12345678",
        control_prefix="s3://away/control",
        boot_timeout_s=60,
    ).save("away", overwrite=True)
    path = tmp_path / "away.json"
    path.write_text(
        json.dumps(
            {
                "name": "away-fleet",
                "ssh_key": "fleet-test-key",
                "ec2": {"block": "away", "instance_types": ["g6.xlarge"], "nodes": {"max": 1}},
            }
        )
    )
    key = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    Secret(value=key.read_text()).save("fleet-test-key", overwrite=True)
    done = cli(prefect_api, gpuflow_home, "fleet", "apply", str(path))
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if not line.startswith("[gpuflow] using")]
    assert len(said) == 1 and "Traceback" not in done.stderr, done.stderr
    assert said[0].startswith("gpuflow: EC2 in us-east-1 did not answer when asked to list GPU")
    assert Away.endpoint in said[0], said
    with pytest.raises(ValueError):
        GpuFleet.load("away-fleet")


@pytest.mark.timeout(600)
def test_an_elastic_fleet_grows_for_a_services_second_replica_and_shrinks_after_it(
    elastic, prefect_api, gpuflow_home
):
    """A service of one-GPU replicas (min 1, max 2) on an elastic fleet of one-GPU
    instances: its first replica grows the fleet to one instance; a load that needs a
    second replica grows it to two; when the load stops, the second replica's claim is
    given back and the scaler ends that instance while the service goes on serving."""
    import signal

    from tests.e2e.test_service import SERVE, Served, ask, endpoint_pids
    from tests.e2e.test_service_fleet import fleet_service

    ec2 = elastic["ec2"]
    port = free_port()
    raw = fleet_service(port, replicas={"min": 1, "max": 2}, scaling={"rps": 15})
    raw["placement"] = {"backend": "fleet", "fleet": "elastic", "gpu_wait": "2m"}
    served = Served(raw, gpuflow_home)
    served.thread.start()
    try:
        wait_for(lambda: endpoint_pids(port), 180, "the endpoint listening")
        assert ask(port, timeout=120)[0] == 200
        assert len(fleet_instances(ec2, ["pending", "running"])) == 1
        load = subprocess.Popen(
            ["wrk", "-t2", "-c8", "-d300s", f"http://127.0.0.1:{port}/"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(lambda: len(fleet_instances(ec2, ["running"])) == 2, 180, "a second instance")
            wait_for(
                lambda: sum(1 for _ in serving_replicas(SERVE, elastic["bed"])) == 2,
                180,
                "the second replica",
            )
        finally:
            load.send_signal(signal.SIGINT)
            text, _ = load.communicate(timeout=30)
        assert "Non-2xx" not in text and "Socket errors" not in text, text
        wait_for(
            lambda: sum(1 for _ in serving_replicas(SERVE, elastic["bed"])) == 1,
            120,
            "back to one replica",
        )
        time.sleep(10)  # idle_duration: the instance the second replica gave back is idle
        done = cli(prefect_api, gpuflow_home, "fleet", "scale", "elastic")
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count("shrink") == 1, done.stdout  # the serving one is kept
        wait_for(lambda: len(fleet_instances(ec2, ["pending", "running"])) == 1, 60, "one instance")
        assert ask(port)[0] == 200  # still served, by the first replica's instance
        served.cancel()
    finally:
        if served.thread.is_alive():
            served.cancel()
    assert served.state is not None and served.state.is_cancelled(), served.state
    [path] = (gpuflow_home / "runs").glob("*/outputs/result.json")
    result = json.loads(path.read_text())
    assert result["most_replicas"] == 2 and result["errors"] == 0
    assert len({r["host"] for r in result["replicas"]}) == 2  # two instances
