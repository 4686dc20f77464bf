"""An elastic fleet on Alibaba Cloud ECS and on Tencent Cloud CVM: their fakes
(tests/fakes/alibaba_ecs.py, tencent_cvm.py) launch the instances, each played as a host of
a fleet test bed at the address the fake gives it (tests/e2e/fleet_bed.py
PlayedFleetOnFake), its real user-data letting the fleet's key in and publishing its host
key to the fleet's records (moto's S3 standing in for OSS and COS) with the role's
credentials from the fake's metadata service. The same fleet machinery as EC2's
(tests/e2e/test_fleet_ec2.py), through each cloud's provider."""

from __future__ import annotations

import json
import time

import pytest

from gpuflow.flows.pipeline import gpu_pipeline
from gpuflow.tasks.spec import load_spec
from tests.e2e.alibaba_bed import ECS_FLEET, PRICES, RATE, objects_under
from tests.e2e.fleet_bed import PlayedFleetOnFake, fleet_bed
from tests.e2e.helpers import gpuflow
from tests.e2e.tencent_bed import CVM_FLEET
from tests.e2e.tencent_bed import METADATA as CVM_METADATA
from tests.e2e.test_fleet import wait_for
from tests.e2e.test_fleet_ec2 import cli, elastic_spec
from tests.fakes import alibaba_ecs, tencent_cvm

FLEET = "on-a-cloud"  # not test_fleet_ec2.py's: the Prefect API (and its events) is shared


def fleet_spec(command: list[str], name: str) -> dict:
    spec = elastic_spec(command, name)
    spec["placement"]["fleet"] = FLEET
    return spec


CLOUDS = {
    # cloud: (fixture, block, the fleet's instance type, its GPUs and product, metadata
    # variable, control prefix, its CNY price an hour)
    "alibaba": (
        "ecs",
        ECS_FLEET,
        "ecs.gn6i-c4g1.xlarge",
        (1, "T4"),
        "GPUFLOW_ECS_METADATA_ENDPOINT",
        "control-ecs",
        alibaba_ecs.TYPES["ecs.gn6i-c4g1.xlarge"][6],
    ),
    "tencent": (
        "cvm",
        CVM_FLEET,
        "GN7.2XLARGE32",
        (1, "T4"),
        CVM_METADATA,
        "control-cvm",
        tencent_cvm.TYPES["GN7.2XLARGE32"][4],
    ),
}


@pytest.fixture(params=list(CLOUDS))
def cloud_fleet(request, prefect_api, tmp_path, s3_server):
    """Fleet FLEET on one cloud: no listed host; at most one instance; idle 10 s."""
    from prefect.blocks.system import Secret

    from gpuflow.blocks import GpuFleet

    cloud = request.param
    fixture, block, instance_type, product, metadata, prefix, cny = CLOUDS[cloud]
    fake = request.getfixturevalue(fixture)
    with fleet_bed(tmp_path / "bed", []) as bed:
        Secret(value=bed["key"]).save("fleet-test-key", overwrite=True)
        section = {
            "block": block,
            "nodes": {"min": 0, "max": 1},
            "instance_types": [instance_type],
            "user": "root",
            "idle_duration_s": 10,
            "grow_after_s": 0,
            "price_table": PRICES,
        }
        if cloud == "alibaba":
            section["ssh_from"] = [f"{bed['address']}/32"]
        GpuFleet(ssh_key="fleet-test-key", lease_s=10, **{cloud: section}).save(
            FLEET, overwrite=True
        )
        with PlayedFleetOnFake(fake, bed, {instance_type: product}, metadata) as played:
            yield {
                "cloud": cloud,
                "fake": fake,
                "played": played,
                "type": instance_type,
                "prefix": prefix,
                "cny": cny,
            }
            cli(prefect_api, tmp_path / "home", "fleet", "delete", FLEET)


def fleet_instances(fake) -> list[dict]:
    return [i for i in list(fake.instances.values()) if i["Tags"].get("gpuflow.io/fleet") == FLEET]


@pytest.mark.timeout(420)
def test_an_elastic_fleet_grows_on_the_cloud_reuses_its_instance_and_shrinks_to_zero(
    cloud_fleet, prefect_api, gpuflow_home, s3_server, tmp_path, capsys
):
    """A run waiting for GPUs grows the fleet by one instance of the cloud (max 1); the
    next run takes it warm; offers price growing in CNY and USD; past idle_duration the
    scaler ends it; `fleet delete` leaves nothing in the cloud or its object storage."""
    fake, played = cloud_fleet["fake"], cloud_fleet["played"]
    first = gpu_pipeline(load_spec(fleet_spec(["hostname"], "first")), return_state=True)
    assert first.is_completed(), (first.message, played.errors, played.console)
    [instance] = fleet_instances(fake)
    host = first.result().cluster.node_names[0]
    assert host == instance["InstanceId"] and instance["InstanceType"] == cloud_fleet["type"]
    assert instance["Tags"]["gpuflow.io/owner"] == "gpuflow-fleet"  # not the reaper's to end
    # the host key came from the instance, through object storage with the role's keys
    home = played.booted[host]
    user_data = (home / "user-data").read_text()
    assert (home / "host_key.pub").read_text().split()[1] not in user_data
    assert "PRIVATE KEY" not in user_data and s3_server.secret not in user_data
    assert objects_under(s3_server, f"{cloud_fleet['prefix']}/fleets/{FLEET}/hosts/")
    # the next run: the warm instance, no launch
    warm = gpu_pipeline(load_spec(fleet_spec(["echo", "warm"], "warm")), return_state=True)
    assert warm.is_completed(), warm.message
    warm_ended = time.time()
    assert fake.actions().count("RunInstances") == 1
    assert warm.result().cluster.node_names[0] == host
    if cloud_fleet["cloud"] == "alibaba":  # its own security group: SSH from ssh_from only
        [group] = [g for g in fake.groups.values() if g["Tags"].get("gpuflow.io/fleet")]
        ssh = [r for r in group["Rules"] if r.get("PortRange") == "22/22"]
        assert [r["SourceCidrIp"] for r in ssh] == [f"{played.bed['address']}/32"]
    # offers: the warm instance's free GPU, then growing (the fleet is at its max)
    job = tmp_path / "job.json"
    job.write_text(json.dumps(fleet_spec(["true"], "offered")))
    code, out, err = gpuflow(capsys, "offers", str(job), "--json")
    assert code == 0, out + err
    rows = json.loads(out)
    assert any(row["where"] == f"fleet/{FLEET} {host}" for row in rows), rows
    grow = next(row for row in rows if "(new)" in row["where"])
    assert grow["where"] == f"fleet/{FLEET} +1 x {cloud_fleet['type']} (new)"
    assert grow["hourly_usd"] == pytest.approx(cloud_fleet["cny"] * RATE, rel=0.01), grow
    code, out, err = gpuflow(capsys, "fleet", "status", FLEET, "--json")
    assert code == 0, out + err
    [shown] = json.loads(out)["instances"]
    assert shown["instance"] == host and shown["used_hours"] > 0
    # idle past idle_duration (10 s, from the warm run's end): one scaler period ends it
    time.sleep(max(0.0, 10.5 - (time.time() - warm_ended)))
    code, out, err = gpuflow(capsys, "fleet", "scale", FLEET)
    assert code == 0, out + err
    assert out.count("shrink") == 1, out
    wait_for(lambda: not played.booted, 60, "the host's power cut")
    code, out, err = gpuflow(capsys, "fleet", "delete", FLEET)
    assert code == 0, out + err
    assert fleet_instances(fake) == []
    if cloud_fleet["cloud"] == "alibaba":
        assert not [g for g in fake.groups.values() if g["Tags"].get("gpuflow.io/fleet")]
    assert objects_under(s3_server, f"{cloud_fleet['prefix']}/fleets/") == []


def test_bad_input_for_a_fleet_on_alibaba_or_tencent_is_one_sentence_before_anything_is_made(
    ecs, cvm, s3_server, tmp_path, capsys, monkeypatch
):
    """Each: `gpuflow fleet apply` exits 2 with one sentence naming the field and the fix;
    no instance, security group or record is made."""
    import subprocess

    import yaml
    from prefect.blocks.system import Secret

    from gpuflow.cli import main
    from tests.e2e.alibaba_bed import save_blocks

    monkeypatch.delenv("GPUFLOW_USD_PER_CNY", raising=False)
    key = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    Secret(value=key.read_text()).save("fleet-test-key", overwrite=True)
    ecs_section = {"block": ECS_FLEET, "instance_types": ["ecs.gn6i-c4g1.xlarge"]}
    priced = ecs_section | {"price_table": PRICES}
    cases = [
        (
            {"ec2": {"block": "b", "instance_types": ["g6.xlarge"]}, "alibaba": priced},
            "ec2 and alibaba: an elastic fleet grows on one cloud; keep one of these sections",
        ),
        (
            {"alibaba": priced | {"instance_types": ["gn6i-c4g1.xlarge"]}},
            "'gn6i-c4g1.xlarge' is not an ECS instance type; write e.g. ecs.gn7i-c8g1.2xlarge",
        ),
        (
            {"tencent": {"block": CVM_FLEET, "instance_types": ["GN7.2XLARGE32"],
                         "ssh_from": ["10.0.0.0/8"]}},
            "ssh_from: a Tencent Cloud fleet's instances join the CvmGpuFleet's security_group",
        ),
        (
            {"alibaba": ecs_section},
            "fleet 'bad' alibaba.price_table: ECS prices cn-hangzhou in CNY, and gpuflow"
            " compares, caps (limits.max_cost_usd) and reports costs in USD; give the rate: a"
            " GpuPriceTable block with usd_per_unit: {CNY: <USD per CNY>} named in fleet 'bad'"
            " alibaba.price_table, or GPUFLOW_USD_PER_CNY.",
        ),
        (
            {"alibaba": priced | {"block": "nowhere"}},
            "fleet 'bad' alibaba.block: ",
        ),
        (
            {"alibaba": priced | {"instance_types": ["ecs.gn5-c4g1.xlarge"]}},
            "fleet 'bad' alibaba.instance_types: none of ecs.gn5-c4g1.xlarge is offered with"
            " GPUs in cn-hangzhou",
        ),
        (
            {"tencent": {"block": CVM_FLEET, "instance_types": ["GN7.2XLARGE32"]}},
            "fleet 'bad' tencent.price_table: CVM prices ap-guangzhou in CNY",
        ),
        ("no control prefix", "control_prefix: an elastic fleet keeps its records there"),
        ("no role", "ram_role: the instances' agent reads and writes the control prefix"),
    ]  # fmt: skip
    for fleet, said in cases:
        if fleet in ("no control prefix", "no role"):
            blank = "control_prefix" if fleet == "no control prefix" else "ram_role"
            save_blocks(ecs, s3_server, **{blank: None})
            fleet = {"alibaba": priced}
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({"name": "bad", "ssh_key": "fleet-test-key", **fleet}))
        assert main(["fleet", "apply", str(path)]) == 2, said
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("gpuflow: ")]
        assert len(lines) == 1 and said in lines[0], (said, err)
        assert "Traceback" not in err
    # gpuflow installed without the alibaba extra (its SDK cannot be imported here)
    save_blocks(ecs, s3_server)
    hide_module(monkeypatch, "alibabacloud_ecs20140526")
    path.write_text(yaml.safe_dump({"name": "bad", "ssh_key": "fleet-test-key", "alibaba": priced}))
    assert main(["fleet", "apply", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith(
        "fleet 'bad' alibaba: an elastic fleet on ECS needs alibabacloud_ecs20140526, which this"
        " gpuflow was installed without; install its extra: pip install 'gpuflow[alibaba]'."
    ), err
    for fake in (ecs, cvm):
        assert not {"RunInstances", "CreateSecurityGroup"} & set(fake.actions()), fake.actions()
    assert objects_under(s3_server, "control-ecs/fleets/") == []


@pytest.mark.parametrize("header", ["x-oss-forbid-overwrite", "x-cos-forbid-overwrite"])
def test_a_conditional_write_to_oss_or_cos_sends_its_own_forbid_overwrite_header(s3_server, header):
    """A fleet's slots are taken with conditional writes: on OSS and COS the store's own
    header goes with S3's If-None-Match (only on those writes), and the store's refusal
    (409 FileAlreadyExists, where it does not honour If-None-Match) is a slot taken."""
    from botocore.stub import Stubber

    from gpuflow.tasks.backends.instances.mailbox import Mailbox, s3_compatible

    keys = (s3_server.key_id, s3_server.secret, None)
    s3 = s3_compatible(s3_server.endpoint, "us-east-1", keys, header)
    sent: list[dict] = []
    s3.meta.events.register(
        "before-send.s3.PutObject", lambda request, **_: sent.append(dict(request.headers))
    )
    box = Mailbox(s3, f"s3://{s3_server.bucket}/conditional-{header}", "fleets/f")
    assert box.put_new("slots/0", "{}") is True
    assert box.put_new("slots/0", "{}") is False  # moto honours If-None-Match: 412
    box.put("wants/run", "{}")
    assert [h.get(header) for h in sent] == [b"true", b"true", None], sent
    stubbed = s3_compatible(s3_server.endpoint, "us-east-1", keys, header)
    with Stubber(stubbed) as stub:
        stub.add_client_error("put_object", "FileAlreadyExists", "exists", 409)
        assert Mailbox(stubbed, f"s3://{s3_server.bucket}/c", "f").put_new("slots/0", "{}") is False


def hide_module(monkeypatch, name: str) -> None:
    """Make `name` (and its submodules) impossible to import for this test, as where it
    was never installed."""
    import sys

    class NotInstalled:
        def find_spec(self, wanted, path=None, target=None):
            if wanted.partition(".")[0] == name:
                raise ModuleNotFoundError(f"No module named {wanted!r}", name=wanted)
            return None

    monkeypatch.setattr(sys, "meta_path", [NotInstalled(), *sys.meta_path])
    for loaded in [m for m in sys.modules if m.partition(".")[0] == name]:
        monkeypatch.delitem(sys.modules, loaded)
