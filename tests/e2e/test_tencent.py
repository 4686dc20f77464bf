"""Tencent Cloud CVM: runs on played instances of the fake CVM (tests/fakes/tencent_cvm.py,
TC3 signatures and request and response models checked with Tencent's SDK) with moto's S3
as COS: the agent with the CAM role's credentials from the metadata service, spot
instances and their notice, self-termination, a pool run moving between clouds on a
preemption (Alibaba to Tencent, Tencent to AWS), offers of three clouds side by side, and
the bad inputs in one sentence each."""

from __future__ import annotations

import base64
import json
import sys
import threading
import time

import pytest

from tests.e2e.alibaba_bed import ecs_spec, left_on_ecs, refused_in_one_sentence
from tests.e2e.tencent_bed import CVM_FLEET, cvm_spec, left_on_cvm
from tests.e2e.test_alibaba import COUNTER, HELLO, _run, oss

pytestmark = pytest.mark.e2e


def test_a_job_runs_on_a_cvm_instance_and_teardown_leaves_nothing(cvm, played_cvm, s3_server):
    from prefect.settings import PREFECT_API_KEY, temporary_settings

    from tests.e2e.helpers import logs_of

    api_key = "pnu_gpuflowTestCvmAgentKey0123456789abcd"
    raw = cvm_spec([sys.executable, "-c", HELLO], env={"GREETING": "ni hao"})
    with temporary_settings({PREFECT_API_KEY: api_key}):
        state, run_id = _run(raw)
    assert state.is_completed(), f"{state.message}\n{played_cvm.consoles()}"
    [instance] = played_cvm.root.iterdir()
    logs = "\n".join(logs_of(run_id))
    assert "hello from node 0" in logs and "role key given: True" in logs
    assert f"agent on {instance.name}: ready at 127.0.0.1" in logs
    [launch] = [q for a, q in cvm.calls if a == "RunInstances"]
    assert launch["InstanceType"] == "GN7.2XLARGE32"  # the cheapest T4
    assert launch["InstanceChargeType"] == "POSTPAID_BY_HOUR"
    assert launch["InternetAccessible"] == {"PublicIpAssigned": False, "InternetMaxBandwidthOut": 0}
    assert launch["CamRoleName"] == "gpuflow-agent" and launch["SecurityGroupIds"] == ["sg-test"]
    sent = base64.b64decode(launch["UserData"]).decode()
    assert "gpuflow.tasks.backends.tencent.agent" in sent
    for text in (sent, played_cvm.console(instance.name), logs, json.dumps(cvm.calls)):
        assert s3_server.secret not in text and api_key not in text and "ni hao" not in text
    assert left_on_cvm(cvm, s3_server, run_id) == []


def _reclaim_when_running(fake, s3_server, prefix: str, interrupted: list[str]):
    """A watch: once a unit on one of `fake`'s instances has sent log lines, that instance
    gets its spot termination time (10 s ahead)."""
    s3 = oss(s3_server)

    def reclaim() -> None:
        until = time.monotonic() + 180
        while time.monotonic() < until and not interrupted:
            listed = s3.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/")
            keys = [o["Key"] for o in listed.get("Contents", [])]
            for item in list(fake.instances.values()):
                unit = f"/nodes/{item['InstanceId']}/units/"
                if any(unit in k and "/log/" in k for k in keys):
                    interrupted.append(item["InstanceId"])
                    fake.interrupt(item["InstanceId"], warning_s=10)
                    return
            time.sleep(0.2)

    return reclaim


def test_a_job_preempted_on_tencent_resumes_on_aws(aws, played, cvm, played_cvm, s3_server):
    """One pool run: a CVM spot instance first, EC2 next; CVM's termination time reaches
    the job through the agent, it saves its step and exits 75, and goes on on EC2."""
    from tests.e2e.conftest import FLEET
    from tests.e2e.helpers import logs_of
    from tests.e2e.test_ec2 import left_of
    from tests.e2e.test_ec2 import spec as ec2_spec

    key = f"ckpt/{time.monotonic_ns()}"
    command = [sys.executable, "-c", COUNTER, s3_server.bucket, key]
    raw = cvm_spec(command, placement={"market": "spot"}, limits={"stop_grace_s": 20})
    raw["placement"] = [raw["placement"], ec2_spec(command)["placement"] | {"block": FLEET}]
    raw["resources"] = {"gpus": 1}
    raw["placement_policy"] = {"choose": "in-order"}
    interrupted: list[str] = []
    watch = _reclaim_when_running(cvm, s3_server, "control-cvm", interrupted)
    threading.Thread(target=watch, daemon=True).start()
    state, run_id = _run(raw)
    assert state.is_completed(), f"{state.message}\n{played_cvm.consoles()}"
    assert len(interrupted) == 1
    logs = "\n".join(logs_of(run_id))
    saved = int(logs.split("saved at step ")[1].split()[0])
    assert saved > 0 and f"done at step 40 resumed from {saved}" in logs
    [launch] = [q for a, q in cvm.calls if a == "RunInstances"]
    assert launch["InstanceChargeType"] == "SPOTPAID"
    assert launch["InstanceMarketOptions"]["SpotOptions"]["SpotInstanceType"] == "one-time"
    assert state.result().cluster.backend == "ec2"
    assert left_on_cvm(cvm, s3_server, run_id) == []
    assert not any(left_of(aws, s3_server, run_id).values())


def test_a_job_preempted_on_alibaba_resumes_on_tencent(ecs, played_ecs, cvm, played_cvm, s3_server):
    """One pool run: a preemptible ECS instance first, a CVM instance next."""
    from tests.e2e.helpers import logs_of

    key = f"ckpt/{time.monotonic_ns()}"
    command = [sys.executable, "-c", COUNTER, s3_server.bucket, key]
    first = ecs_spec(command, placement={"market": "spot"})["placement"]
    raw = cvm_spec(command, limits={"stop_grace_s": 20})
    raw["placement"] = [first, raw["placement"]]
    raw["resources"] = {"gpus": 1, "gpu_product": "T4"}
    raw["placement_policy"] = {"choose": "in-order"}
    interrupted: list[str] = []
    watch = _reclaim_when_running(ecs, s3_server, "control-ecs", interrupted)
    threading.Thread(target=watch, daemon=True).start()
    state, run_id = _run(raw)
    assert state.is_completed(), (
        f"{state.message}\n{played_ecs.consoles()}\n{played_cvm.consoles()}"
    )
    assert len(interrupted) == 1
    logs = "\n".join(logs_of(run_id))
    saved = int(logs.split("saved at step ")[1].split()[0])
    assert saved > 0 and f"done at step 40 resumed from {saved}" in logs
    assert state.result().cluster.backend == "tencent"
    assert left_on_ecs(ecs, s3_server, run_id) == []
    assert left_on_cvm(cvm, s3_server, run_id) == []


def test_offers_of_three_clouds_side_by_side(aws, ecs, cvm, capsys, tmp_path):
    """`gpuflow offers` on one job placed on EC2, ECS and CVM: every cloud's offers, ranked
    in USD, the Chinese clouds' with their CNY price."""
    import yaml

    from gpuflow.cli import main
    from tests.e2e.conftest import FLEET
    from tests.e2e.test_ec2 import spec as ec2_spec

    raw = {
        "name": "offers-three-clouds",
        "job": {"kind": "command", "command": ["true"]},
        "resources": {"gpus": 1},
        "limits": {"max_duration": "2h"},
        "placement": [
            ec2_spec(["true"])["placement"] | {"block": FLEET},
            ecs_spec(["true"])["placement"],
            cvm_spec(["true"])["placement"],
        ],
        "placement_policy": {"choose": "cheapest"},
    }
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["offers", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["where"].split("/")[0] for row in rows} == {"ec2", "alibaba", "tencent"}
    t4 = next(r for r in rows if "GN7.2XLARGE32 on-demand" in r["where"])
    assert "(8.68 CNY/h)" in t4["where"] and t4["hourly_usd"] == pytest.approx(8.68 * 0.14)
    assert main(["offers", str(path)]) == 0
    table = capsys.readouterr().out
    assert "3 candidate(s) for 1 node(s) x 1 GPU(s), tried cheapest" in table


@pytest.mark.parametrize(
    ("fleet", "job", "expected"),
    [
        (
            {"region": "ap-guangzou"},
            {},
            "CvmGpuFleet 'gpuflow-test-bad' region: 'ap-guangzou' is not a Tencent Cloud"
            " region; use one such as ap-guangzhou",
        ),
        (
            {"subnets": {"ap-guangzhou-9": "subnet-9"}},
            {},
            "CvmGpuFleet 'gpuflow-test-bad' subnets: 'ap-guangzhou-9' is not a zone of"
            " ap-guangzhou; zones there:",
        ),
        (
            {"families": ["S5"]},
            {},
            "CvmGpuFleet 'gpuflow-test-bad' families: S5 has no GPU instance type in ap-guangzhou;",
        ),
        (
            {"families": ["GN77"]},
            {},
            "families: GN77 is not an instance family CVM sells in ap-guangzhou;",
        ),
        (
            {"credentials": "gpuflow-test-tencent-wrong"},
            {},
            "Tencent Cloud CVM in ap-guangzhou refused the credentials from the"
            " TencentCredentials block 'gpuflow-test-tencent-wrong'"
            " (AuthFailure.SignatureFailure: The provided credentials could not be validated.)",
        ),
        (
            {},
            {"placement": {"market": "spot", "spot_price_limit": 1.0}},
            "placement.spot_price_limit: 1.00 CNY/h is below the spot price of every fitting"
            " type (the lowest: GN7.2XLARGE32 in ap-guangzhou-3 at 1.74 CNY/h);",
        ),
        (
            {"cam_role": None},
            {},
            "CvmGpuFleet 'gpuflow-test-bad' cam_role: the instances' agent reads and writes"
            " the control prefix and terminates its own instance",
        ),
    ],
)
def test_bad_input_is_one_sentence_and_nothing_is_launched(
    cvm, tmp_path, capsys, fleet, job, expected
):

    from gpuflow.blocks import CvmGpuFleet, TencentCredentials

    TencentCredentials(secret_id=cvm.secret_id, secret_key="not-the-key").save(
        "gpuflow-test-tencent-wrong", overwrite=True
    )
    settings = CvmGpuFleet.load(CVM_FLEET).model_dump(exclude={"block_type_slug"}) | fleet
    CvmGpuFleet(**settings).save("gpuflow-test-bad", overwrite=True)
    raw = cvm_spec(["true"], placement={"block": "gpuflow-test-bad"})
    for name, values in job.items():
        raw[name] = {**raw[name], **values}
    refused_in_one_sentence(capsys, tmp_path, raw, expected, "not-the-key")
    assert "RunInstances" not in cvm.actions() and not cvm.instances


def test_an_orphaned_cvm_instance_terminates_itself_and_quota_is_cvms_sentence(
    cvm, played_cvm, s3_server
):
    from gpuflow.tasks.backends.instances import backend as instances
    from gpuflow.tasks.backends.registry import get_backend
    from gpuflow.tasks.contract import owner_labels
    from gpuflow.tasks.spec import load_spec

    spec = load_spec(cvm_spec(["true"], limits={"orphan_after": "10s"}))
    backend = get_backend("tencent", spec.placement)
    run_id = f"orphan-cvm-{time.monotonic_ns()}"
    cluster = backend.provision(spec, owner_labels(run_id, spec.name))
    try:
        state = instances.state_of(cluster, instances.InstanceState)
        [instance] = [n.instance_id for n in state.instances]
        instances._heartbeats.pop(run_id).stop()  # the orchestrator is gone
        until = time.monotonic() + 90
        while instance in cvm.instances:
            assert time.monotonic() < until, played_cvm.consoles()
            time.sleep(0.2)
        [ended] = [q for a, q in cvm.calls if a == "TerminateInstances"]
        assert ended == {"InstanceIds": [instance]}
    finally:
        backend.teardown(cluster)
    assert left_on_cvm(cvm, s3_server, run_id) == []

    cvm.quota_left = 0
    state, run_id = _run(cvm_spec(["true"]))
    assert state.is_failed()
    assert (
        "Tencent Cloud CVM in ap-guangzhou said LimitExceeded.InstanceQuota (The number of"
        " instances exceeds the quota of the account in the region.) when asked for 1 x"
        " GN7.2XLARGE32: no quota left in the region;" in str(state.message)
    )
    assert left_on_cvm(cvm, s3_server, run_id) == []
