"""Alibaba Cloud ECS: runs on played instances of the fake ECS (tests/fakes/alibaba_ecs.py,
signatures and parameters checked with Alibaba's SDK) with moto's S3 as OSS: the agent
started by user-data that names the run's own wheel (its presigned URL and hash), with the
RAM role's credentials from the metadata service, the spot notice, self-termination, reaping
by owner tags, offers in CNY, and the bad inputs in one sentence each."""

from __future__ import annotations

import base64
import json
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.alibaba_bed import ecs_spec, left_on_ecs, refused_in_one_sentence

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


def oss(s3_server):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=s3_server.key_id,
        aws_secret_access_key=s3_server.secret,
    )


@pytest.mark.parametrize(
    ("fleet", "job", "expected"),
    [
        (
            {"region": "cn-hangzou"},
            {},
            "EcsGpuFleet 'gpuflow-test-bad' region: 'cn-hangzou' is not an Alibaba Cloud"
            " region; use one such as cn-hangzhou",
        ),
        (
            {"vswitches": {"cn-hangzhou-x": "vsw-x"}},
            {},
            "EcsGpuFleet 'gpuflow-test-bad' vswitches: 'cn-hangzhou-x' is not a zone of"
            " cn-hangzhou; zones there: cn-hangzhou-j, cn-hangzhou-i, cn-hangzhou-h.",
        ),
        (
            {"families": ["ecs.g7"]},
            {},
            "EcsGpuFleet 'gpuflow-test-bad' families: ecs.g7 has no GPU instance type in"
            " cn-hangzhou; GPU families there:",
        ),
        (
            {"families": ["ecs.gn6x"]},
            {},
            "families: ecs.gn6x has no GPU instance type in cn-hangzhou; GPU families there:"
            " ecs.gn6v, ecs.gn6i, ecs.gn7.",
        ),
        (
            {},
            {"resources": {"gpu_product": "H100"}},
            "resources.gpu_product: no ECS instance type in cn-hangzhou (families ecs.gn6i,"
            " ecs.gn7i) has NVIDIA-H100-80GB-HBM3; types there have NVIDIA-A10, Tesla-T4;",
        ),
        (
            {},
            {"placement": {"market": "spot", "spot_price_limit": 1.0}},
            "placement.spot_price_limit: 1.00 CNY/h is below the spot price of every fitting"
            " type (the lowest: ecs.gn6i-c4g1.xlarge in cn-hangzhou-i at 2.30 CNY/h);",
        ),
        (
            {},
            {"placement": {"price_table": None}},
            "placement.price_table: ECS prices cn-hangzhou in CNY, and gpuflow compares, caps"
            " (limits.max_cost_usd) and reports costs in USD; give the rate:",
        ),
        (
            {},
            {"limits": {"max_cost_usd": 0.1}},
            "limits.max_cost_usd: $0.1 buys less than one hour of the cheapest fitting offer"
            " (ecs.gn6i-c4g1.xlarge (1 x Tesla-T4) on-demand in cn-hangzhou-i: 11.50 CNY/h"
            " ($1.610/h))",
        ),
        (
            {"credentials": "gpuflow-test-aliyun-wrong"},
            {},
            "Alibaba Cloud ECS in cn-hangzhou refused the credentials from the"
            " AlibabaCredentials block 'gpuflow-test-aliyun-wrong' (SignatureDoesNotMatch:"
            " Specified signature is not matched with our calculation.)",
        ),
        (
            {"ram_role": None},
            {},
            "EcsGpuFleet 'gpuflow-test-bad' ram_role: the instances' agent reads and writes"
            " the control prefix and deletes its own instance with the instance's RAM role;",
        ),
    ],
)
def test_bad_input_is_one_sentence_and_nothing_is_made(
    ecs, s3_server, tmp_path, capsys, monkeypatch, fleet, job, expected
):

    from gpuflow.blocks import AlibabaCredentials, EcsGpuFleet
    from tests.e2e.alibaba_bed import ECS_FLEET

    monkeypatch.delenv("GPUFLOW_USD_PER_CNY", raising=False)
    AlibabaCredentials(access_key_id=ecs.key_id, access_key_secret="not-the-secret").save(
        "gpuflow-test-aliyun-wrong", overwrite=True
    )
    settings = EcsGpuFleet.load(ECS_FLEET).model_dump(exclude={"block_type_slug"}) | fleet
    EcsGpuFleet(**settings).save("gpuflow-test-bad", overwrite=True)
    raw = ecs_spec(["true"], placement={"block": "gpuflow-test-bad"})
    for name, values in job.items():
        raw[name] = {**raw[name], **values}
    raw["placement"] = {k: v for k, v in raw["placement"].items() if v is not None}
    refused_in_one_sentence(capsys, tmp_path, raw, expected, "not-the-secret")
    made = {"RunInstances", "CreateSecurityGroup"} & set(ecs.actions())
    assert not made and not ecs.instances and not ecs.groups  # nothing launched or made


def test_no_stock_moves_to_the_next_offer_and_no_quota_is_the_apis_sentence(
    ecs, played_ecs, s3_server
):
    """The cheapest offer's zone ran out of stock since it was listed: the launch says so
    and takes the next one. With no GPU quota left in the region, the run ends with ECS's own error, named,
    and leaves nothing."""
    from tests.e2e.helpers import logs_of

    ecs.gone_at_launch.add(("ecs.gn6i-c4g1.xlarge", "cn-hangzhou-i"))
    state, run_id = _run(ecs_spec([sys.executable, "-c", "print('in stock')"]))
    assert state.is_completed(), f"{state.message}\n{played_ecs.consoles()}"
    logs = "\n".join(logs_of(run_id))
    assert (
        "no ecs.gn6i-c4g1.xlarge (on-demand) in cn-hangzhou-i (OperationDenied.NoStock);"
        " trying the next offer" in logs
    )
    assert "launched 1 x ecs.gn6i-c4g1.xlarge (on-demand) in cn-hangzhou-j" in logs
    assert left_on_ecs(ecs, s3_server, run_id) == []

    ecs.quota_left = 0
    state, run_id = _run(ecs_spec(["true"]))
    assert state.is_failed()
    assert (
        "Alibaba Cloud ECS in cn-hangzhou said QuotaExceed.PostPaidInstance (The GPU quota of"
        " pay-as-you-go instances in the region is exceeded.) when asked for 1 x"
        " ecs.gn6i-c4g1.xlarge: no quota left in the region;" in str(state.message)
    )
    assert left_on_ecs(ecs, s3_server, run_id) == []


def test_an_orphaned_instance_deletes_itself_with_its_ram_role(ecs, played_ecs, s3_server):
    """The orchestrator's heartbeat stops (its process is gone): after limits.orphan_after
    the agent stops its unit and deletes its own instance through ECS's DeleteInstance,
    signed with the RAM role's credentials from the metadata service, and says why."""
    from gpuflow.tasks.backends.instances import backend as instances
    from gpuflow.tasks.backends.registry import get_backend
    from gpuflow.tasks.contract import owner_labels
    from gpuflow.tasks.spec import load_spec

    spec = load_spec(ecs_spec(["true"], limits={"orphan_after": "10s"}))
    backend = get_backend("alibaba", spec.placement)
    run_id = f"orphan-ecs-{time.monotonic_ns()}"
    cluster = backend.provision(spec, owner_labels(run_id, spec.name))
    try:
        [instance] = [
            n.instance_id for n in instances.state_of(cluster, instances.InstanceState).instances
        ]
        instances._heartbeats.pop(run_id).stop()  # the orchestrator is gone
        until = time.monotonic() + 90
        while instance in ecs.instances:
            assert time.monotonic() < until, played_ecs.consoles()
            time.sleep(0.2)
        [deleted] = [q for a, q in ecs.calls if a == "DeleteInstance"]
        assert deleted["InstanceId"] == instance and deleted["Force"].lower() == "true"
        gone = json.loads(
            oss(s3_server)
            .get_object(Bucket=s3_server.bucket, Key=f"control-ecs/{run_id}/gone/{instance}")[
                "Body"
            ]
            .read()
        )
        assert gone["why"].startswith("the orchestrator's heartbeat has not changed for")
    finally:
        backend.teardown(cluster)
    assert left_on_ecs(ecs, s3_server, run_id) == []


def test_offers_for_an_alibaba_placement_keep_their_currency(ecs, capsys, tmp_path):
    """`gpuflow offers` for a job placed on ECS alone: ECS's own table, cheapest first, in
    CNY and in USD at the rate the price table gives, the rate said (the pool's table, with
    every cloud side by side in USD: tests/e2e/test_tencent.py)."""
    import yaml

    from gpuflow.cli import main

    raw = ecs_spec(["true"], resources={"gpu_product": None}, limits={"max_duration": "2h"})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["offers", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("8 offers on alibaba in cn-hangzhou for 1 GPU(s), on-demand")
    assert "CNY/h" in table[1] and "$/h" in table[1]
    assert table[2].split()[1:7] == [
        "ecs.gn6i-c4g1.xlarge", "cn-hangzhou-i", "on-demand", "1", "x", "Tesla-T4",
    ]  # fmt: skip
    assert table[2].split()[7:10] == ["11.50", "1.610", "3.22"]  # 2 h at 0.14 USD per CNY
    assert "  prices in CNY, in USD at 0.14 USD per CNY (the price table's rate)" in table
