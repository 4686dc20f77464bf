"""Alibaba Cloud ECS: runs on played instances of the fake ECS (tests/fakes/alibaba_ecs.py,
signatures and parameters checked with Alibaba's SDK) with moto's S3 as OSS: the agent
from the run's own wheel (fetched by its presigned URL, checked by hash) with the RAM
role's credentials from the metadata service, the spot notice, self-termination, reaping
by owner tags, offers in CNY, and the bad inputs in one sentence each."""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.alibaba_bed import ecs_spec, left_on_ecs

pytestmark = pytest.mark.e2e

HELLO = (
    "import os, pathlib\n"
    "print('hello from node', os.environ['GPUFLOW_NODE_RANK'], flush=True)\n"
    "print('role key given:', bool(os.environ.get('AWS_ACCESS_KEY_ID')), flush=True)\n"
    "pathlib.Path(os.environ['GPUFLOW_OUTPUT_DIR'], 'answer.txt').write_text('42')\n"
)
# Counts to 40 steps, its step kept in OSS (through the S3 API, with the keys the unit
# was given); on SIGTERM it saves and exits 75; a new try goes on from the saved step.
COUNTER = (
    "import os, signal, sys, time, boto3\n"
    "bucket, key = sys.argv[1], sys.argv[2]\n"
    "s3 = boto3.client('s3')\n"
    "try:\n"
    "    start = int(s3.get_object(Bucket=bucket, Key=key)['Body'].read())\n"
    "except s3.exceptions.NoSuchKey:\n"
    "    start = 0\n"
    "step = start\n"
    "def saved(*_):\n"
    "    s3.put_object(Bucket=bucket, Key=key, Body=str(step).encode())\n"
    "    print('saved at step', step, flush=True); sys.exit(75)\n"
    "signal.signal(signal.SIGTERM, saved)\n"
    "print('started at step', start, flush=True)\n"
    "while step < 40:\n"
    "    step += 1; time.sleep(0.25)\n"
    "    if step % 5 == 0: s3.put_object(Bucket=bucket, Key=key, Body=str(step).encode())\n"
    "print('done at step', step, 'resumed from', start, flush=True)\n"
)


def _run(raw: dict):
    from gpuflow.flows.pipeline import gpu_pipeline
    from gpuflow.tasks.spec import load_spec

    state = gpu_pipeline(load_spec(raw), return_state=True)
    return state, str(state.state_details.flow_run_id)


def test_a_job_runs_on_an_ecs_instance_and_teardown_leaves_nothing(ecs, played_ecs, s3_server):
    from prefect.settings import PREFECT_API_KEY, temporary_settings

    from tests.e2e.helpers import logs_of

    api_key = "pnu_gpuflowTestEcsAgentKey0123456789abcd"  # the agents' token: the run's secret
    raw = ecs_spec([sys.executable, "-c", HELLO], env={"GREETING": "ni hao"})
    with temporary_settings({PREFECT_API_KEY: api_key}):
        state, run_id = _run(raw)
    assert state.is_completed(), f"{state.message}\n{played_ecs.consoles()}"
    result = state.result()
    assert result.exit_code == 0
    [instance] = played_ecs.root.iterdir()
    logs = "\n".join(logs_of(run_id))
    assert "hello from node 0" in logs and "role key given: True" in logs
    assert f"agent on {instance.name}: ready at 127.0.0.1" in logs
    assert Path(result.artifacts_dir, "outputs", "answer.txt").read_text() == "42"
    # what ECS was asked: a locked-down pay-as-you-go instance with the run's RAM role
    [launch] = [q for a, q in ecs.calls if a == "RunInstances"]
    assert launch["InstanceType"] == "ecs.gn6i-c4g1.xlarge"  # the cheapest T4
    assert (launch["SpotStrategy"], launch["InstanceChargeType"]) == ("NoSpot", "PostPaid")
    assert launch["HttpTokens"] == "required" and launch["InternetMaxBandwidthOut"] == "0"
    assert launch["RamRoleName"] == "gpuflow-agent" and launch["VSwitchId"] == "vsw-bp1i"
    assert launch["Tag.1.Key"].startswith("gpuflow.io/")
    # nothing secret in clear: user-data, the instance's console, the run's log, ECS's calls
    sent = base64.b64decode(launch["UserData"]).decode()
    assert "gpuflow.tasks.backends.alibaba.agent" in sent
    calls = json.dumps(ecs.calls)
    for text in (sent, played_ecs.console(instance.name), logs, calls):
        assert s3_server.secret not in text and api_key not in text and "ni hao" not in text
    assert left_on_ecs(ecs, s3_server, run_id) == []


def test_a_spot_notice_saves_the_job_and_it_resumes_on_a_new_instance(ecs, played_ecs, s3_server):
    """ECS sets the preemptible instance's termination time: the agent stops the job with
    SIGTERM (it saves its step to OSS and exits 75), the instance is deleted, and the run
    launches a new one and goes on from the saved step."""
    import threading

    from tests.e2e.helpers import logs_of

    key = f"ckpt/{time.monotonic_ns()}"
    raw = ecs_spec(
        [sys.executable, "-c", COUNTER, s3_server.bucket, key],
        placement={"market": "spot-then-on-demand"},
        limits={"stop_grace_s": 20},
    )
    interrupted: list[str] = []
    s3 = oss(s3_server)

    def running(instance_id: str) -> bool:  # the job on it has sent log lines
        listed = s3.list_objects_v2(Bucket=s3_server.bucket, Prefix="control-ecs/")
        return any(
            f"/nodes/{instance_id}/units/" in o["Key"] and "/log/" in o["Key"]
            for o in listed.get("Contents", [])
        )

    def reclaim() -> None:
        until = time.monotonic() + 180
        while time.monotonic() < until:
            for item in list(ecs.instances.values()):
                if running(item["InstanceId"]):
                    interrupted.append(item["InstanceId"])
                    ecs.interrupt(item["InstanceId"], warning_s=10)
                    return
            time.sleep(0.2)

    threading.Thread(target=reclaim, daemon=True).start()
    state, run_id = _run(raw)
    assert state.is_completed(), f"{state.message}\n{played_ecs.consoles()}"
    assert len(interrupted) == 1
    logs = "\n".join(logs_of(run_id))
    assert "got a spot interruption notice" in logs or "is gone" in logs
    assert "saved at step" in logs
    saved = int(logs.split("saved at step ")[1].split()[0])
    assert f"done at step 40 resumed from {saved}" in logs and saved > 0
    launches = [q for a, q in ecs.calls if a == "RunInstances"]
    assert launches[0]["SpotStrategy"] == "SpotAsPriceGo"
    assert len(launches) == 2 and interrupted[0] not in ecs.instances
    assert left_on_ecs(ecs, s3_server, run_id) == []


def oss(s3_server):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=s3_server.key_id,
        aws_secret_access_key=s3_server.secret,
    )
