"""Alibaba Cloud ECS played on this machine: the fake ECS (tests/fakes/alibaba_ecs.py) with
moto's S3 server standing in for OSS's S3-compatible API, and its instances booted the way
ECS boots them.

Each instance the fake launches gets its real user-data (base64-decoded, as cloud-init
does) run as a local process in a folder of its own (its "disk"), with the variable that
points the agent at its metadata service (GPUFLOW_ECS_METADATA_ENDPOINT: the fake's, for
that instance; on ECS the agent reads 100.100.100.200). No key is in its environment: the
agent takes its RAM role's temporary credentials from the metadata service. An instance
the fake deletes has its processes killed (its units' sessions too), as its power is cut.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil

from tests.fakes.alibaba_ecs import FakeEcs

ECS_FLEET = "gpuflow-test-ecs"
ECS_KEYS = "gpuflow-test-aliyun"
RATE = 0.14  # USD per CNY in the test price table
PRICES = "gpuflow-test-cny"
# the install step: the local build runs the agent (no index to install from here). The
# wheel's presigned URL is checked to be one (moto, with its credential checks on, answers
# presigned requests with HTTP 500: fetching it by curl is not played here).
INSTALL = (
    'case "$GPUFLOW_WHEEL_GET" in *"/control-ecs/"*"/gpuflow/gpuflow-"*".whl?"*"Signature="*) ;;'
    ' *) echo "no presigned wheel URL: $GPUFLOW_WHEEL_GET"; exit 1;; esac'
    f" && GPUFLOW_PYTHON={sys.executable}"
)


class PlayedEcs:
    """Boots the instances `fake` (ECS's, or another cloud's fake with the same hooks)
    launches; powers off those it deletes. `metadata` names the variable that points the
    agent at the instance's metadata service."""

    def __init__(
        self, fake: Any, root: Path, metadata: str = "GPUFLOW_ECS_METADATA_ENDPOINT"
    ) -> None:
        self.fake, self.root, self.metadata = fake, root, metadata
        self.booted: dict[str, subprocess.Popen] = {}
        self.lock = threading.Lock()

    def __enter__(self) -> PlayedEcs:
        self.fake.on_launch = self._boot
        self.fake.on_delete = self._power_off
        return self

    def __exit__(self, *exc: object) -> None:
        self.fake.on_launch = lambda _i: None
        for instance_id in list(self.booted):
            self._power_off({"InstanceId": instance_id})

    def console(self, instance_id: str) -> str:
        path = self.root / instance_id / "console.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def consoles(self) -> str:
        """Every instance's console, for a failing test's message."""
        return "\n".join(
            f"--- {folder.name}\n{self.console(folder.name)}"
            for folder in sorted(self.root.iterdir())
        )

    def _boot(self, instance: dict[str, Any]) -> None:
        if instance["Tags"].get("gpuflow.io/owner") != "gpuflow":
            return
        folder = self.root / instance["InstanceId"]
        folder.mkdir(parents=True, exist_ok=True)
        script = base64.b64decode(instance["UserData"]).decode()
        (folder / "user-data").write_text(script)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(folder),
            self.metadata: self.fake.metadata_url(instance["InstanceId"]),
        }
        process = subprocess.Popen(
            ["bash", str(folder / "user-data")],
            cwd=folder,
            env=env,
            stdout=(folder / "console.log").open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        with self.lock:
            self.booted[instance["InstanceId"]] = process

    def _power_off(self, instance: dict[str, Any]) -> None:
        with self.lock:
            process = self.booted.pop(instance["InstanceId"], None)
        if process is None:
            return
        try:  # the power is cut: every process the instance runs, its units' sessions too
            everything = [psutil.Process(process.pid)]
            everything += everything[0].children(recursive=True)
        except psutil.NoSuchProcess:
            everything = []
        for each in everything:
            with contextlib.suppress(psutil.NoSuchProcess):
                each.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def save_blocks(fake: FakeEcs, s3_server: Any, **settings: Any) -> None:
    """The test's AlibabaCredentials, EcsGpuFleet and price table (a CNY rate) blocks."""
    from gpuflow.blocks import AlibabaCredentials, EcsGpuFleet, GpuPriceTable

    AlibabaCredentials(access_key_id=fake.key_id, access_key_secret=fake.secret).save(
        ECS_KEYS, overwrite=True
    )
    values: dict[str, Any] = {
        "region": "cn-hangzhou",
        "families": ["ecs.gn6i", "ecs.gn7i"],
        "credentials": ECS_KEYS,
        "ram_role": "gpuflow-agent",
        "vpc_id": "vpc-bp1test",
        "vswitches": {"cn-hangzhou-i": "vsw-bp1i", "cn-hangzhou-j": "vsw-bp1j"},
        "image_id": "ubuntu_22_04_x64_20G_alibase_20240101.vhd",
        "control_prefix": f"s3://{s3_server.bucket}/control-ecs",
        "endpoint": fake.endpoint,
        "oss_endpoint": s3_server.endpoint,
        "oss_region": "us-east-1",  # where moto keeps the bucket
        "install": INSTALL,
        "boot_timeout_s": 60,
    }
    EcsGpuFleet(**(values | settings)).save(ECS_FLEET, overwrite=True)
    GpuPriceTable(usd_per_unit={"CNY": RATE}).save(PRICES, overwrite=True)


def ecs_spec(command: list[str], **sections: Any) -> dict[str, Any]:
    job: dict[str, Any] = {
        "name": "ecs-test",
        "job": {"kind": "command", "command": command},
        "resources": {"gpus": 1, "gpu_product": "T4", "disk": "40Gi"},
        "limits": {"max_duration": "10m", "stop_grace_s": 5},
        "placement": {
            "backend": "alibaba",
            "block": ECS_FLEET,
            "market": "on-demand",
            "price_table": PRICES,
        },
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def left_on_ecs(fake: FakeEcs, s3_server: Any, run_id: str) -> list[str]:
    """What ECS and OSS still hold of the run."""

    instances = [
        f"instance {i['InstanceId']}"
        for i in list(fake.instances.values())
        if i["Tags"].get("gpuflow.io/flow-run-id") == run_id
    ]
    groups = [
        f"security group {g['SecurityGroupId']}"
        for g in list(fake.groups.values())
        if g["Tags"].get("gpuflow.io/flow-run-id") == run_id
    ]
    return instances + groups + objects_under(s3_server, f"control-ecs/{run_id}/")


def objects_under(s3_server: Any, prefix: str) -> list[str]:
    """The objects the S3 server (standing in for OSS and COS) holds under `prefix`."""
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint,
        region_name="us-east-1",
        aws_access_key_id=s3_server.key_id,
        aws_secret_access_key=s3_server.secret,
    )
    listed = s3.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)
    return [f"object {o['Key']}" for o in listed.get("Contents", [])]


def refused_in_one_sentence(
    capsys: Any, tmp_path: Path, raw: dict[str, Any], expected: str, hidden: str
) -> None:
    """`gpuflow run` on `raw` exits 2 with one sentence holding `expected`, no traceback
    and nothing of `hidden` (a secret it was given)."""
    import yaml

    from gpuflow.cli import main

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    [said] = [line for line in err.splitlines() if line.startswith("gpuflow: ")]
    assert said.startswith("gpuflow: invalid input: ") and expected in said, err
    assert "Traceback" not in err and hidden not in err
